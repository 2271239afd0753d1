"""Preemption under the real ``deepspeed`` launcher: SIGTERM to the job's process group (what SLURM and
Kubernetes send before they kill) makes every rank finish its step, write a complete checkpoint and exit
with the documented status; ``--resume`` then continues exactly as if nothing had happened. Ctrl-C (SIGINT)
does the same, with one summary line and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from _launch import REPO, deepspeed_cmd, launcher_env, metrics, pretrain_args, release_shm, run
from safetensors.torch import load_file

from ds_bertopt.testing.distributed import free_port
from ds_bertopt.train.loop import PREEMPTED_EXIT

pytestmark = pytest.mark.slow
EXTRA = (
    "--max_steps",
    "12",
    "--log_every",
    "1",
    "--eval_every",
    "0",
    "-o",
    "train.log_samples=true",
    "-o",
    "data.max_documents=60",
)


def _signal_after(cmd: list[str], marker: str, signum: int, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; send ``signum`` to the group once ``marker`` was printed."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump():
        sent = False
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            if marker in line and not sent:
                os.killpg(proc.pid, signum)
                sent = True

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        # the launcher exits once its ranks have; the ranks themselves may take a moment longer
        time.sleep(2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        release_shm(cmd)
    reader.join(timeout=10)
    return proc.returncode, "".join(lines)


@pytest.mark.timeout(500)
def test_sigterm_checkpoints_every_rank_and_resume_is_exact(tmp_path, cache_dir):
    ref, cut = tmp_path / "uninterrupted", tmp_path / "preempted"
    port = str(free_port())
    run(deepspeed_cmd("--num_gpus", "2", "--master_port", port, *pretrain_args(ref, cache_dir, *EXTRA)), 200)
    _, output = _signal_after(
        deepspeed_cmd("--num_gpus", "2", "--master_port", port, *pretrain_args(cut, cache_dir, *EXTRA)),
        marker="step 4/12",
        signum=signal.SIGTERM,
        timeout=200,
    )
    assert f"exit status {PREEMPTED_EXIT}" in output, output[-3000:]
    stopped = json.loads(
        (cut / "checkpoints" / (cut / "checkpoints" / "latest").read_text() / "COMPLETE.json").read_text()
    )["step"]
    assert 4 <= stopped < 12, stopped
    tag = f"step{stopped:08d}"
    assert (
        f"preempted (SIGTERM): stopped after step {stopped} of 12; checkpoint {cut / 'checkpoints' / tag} is " in output
    )
    assert not (cut / "final").exists()

    resumed = run(
        deepspeed_cmd("--num_gpus", "2", "--master_port", port, *pretrain_args(cut, cache_dir, *EXTRA, "--resume")), 200
    )
    assert f"resumed from step{stopped:08d}: step {stopped}" in resumed.stdout
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a), "the resumed run diverged from the uninterrupted one"
    ref_loss = {m["step"]: m["loss"] for m in metrics(ref)[0]}
    cut_loss = {m["step"]: m["loss"] for m in metrics(cut)[0]}
    assert [cut_loss[s] for s in range(1, 13)] == [ref_loss[s] for s in range(1, 13)]


@pytest.mark.timeout(300)
def test_ctrl_c_checkpoints_like_sigterm_without_a_traceback(tmp_path, cache_dir):
    """Ctrl-C was ~85 lines of KeyboardInterrupt tracebacks (from inside zero0.on_grad_ready) and no summary."""
    out = tmp_path / "interrupted"
    code, output = _signal_after(  # with a DataLoader worker: Ctrl-C reaches it too
        [sys.executable, *pretrain_args(out, cache_dir, *EXTRA, "-o", "train.dataloader_workers=1")],
        marker="step 3/12",
        signum=signal.SIGINT,
        timeout=200,
    )
    assert code == PREEMPTED_EXIT, output[-3000:]
    latest = (out / "checkpoints" / "latest").read_text()
    stopped = int(latest[len("step") :])
    assert 3 <= stopped < 12
    assert (
        f"preempted (SIGINT): stopped after step {stopped} of 12; checkpoint {out / 'checkpoints' / latest} is "
        f"complete, continue with --resume (exit status {PREEMPTED_EXIT})"
    ) in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
