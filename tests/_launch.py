"""Helpers for tests that start the real launchers (imported by test modules in this folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `make test-matrix`: every row of the tests that run a matrix; `make test` runs their representative rows
FULL_MATRIX = os.environ.get("DS_BERTOPT_FULL_MATRIX") == "1"


def deepspeed_cmd(*args: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), *args]


def pretrain_args(out: Path, cache_dir: Path, *extra: str, config: str = "ds_configs/bert.json") -> list[str]:
    """Arguments for a small, quick pretraining run on the embedded corpus."""
    return [
        "launch/pretrain.py",
        "--deepspeed_config",
        config,
        "--output_dir",
        str(out),
        "-o",
        f"data.cache_dir={cache_dir}",
        "-o",
        "data.max_documents=150",
        *extra,
    ]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK",
                      "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
"""Set by a launcher for its ranks; in-process tests leave them in this process (accelerate's ``PartialState`` writes
RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE), and a launched job must not inherit them stale."""


def launcher_env(**extra: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in ("DS_BERTOPT_FAULT", *LAUNCHER_VARIABLES):
        env.pop(name, None)
    env.update(extra)
    return env


def release_shm(cmd: list[str]) -> None:
    """Remove DeepSpeed's /dev/shm buffers of a finished launcher job (ranks killed before our code
    unlinked them, or scripts that call deepspeed directly): see ``ds_bertopt.dist.release_shm_buffer``."""
    from ds_bertopt.testing.netns import remove_deepspeed_shm_buffers

    flag = next((f for f in ("--master_port", "--main_process_port") if f in cmd), None)
    port = cmd[cmd.index(flag) + 1] if flag else "29500"
    remove_deepspeed_shm_buffers("127.0.0.1", port)


def run(cmd: list[str], timeout: int, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=launcher_env(**env), capture_output=True, text=True, timeout=timeout)
    finally:
        release_shm(cmd)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def run_timed(cmd: list[str], timeout: int, marker: str, **env: str) -> tuple[int, str, float | None]:
    """Run ``cmd``; return (exit code, output, seconds from the first line containing ``marker`` to exit)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=launcher_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    seen_at: list[float] = []

    def pump():
        for line in iter(proc.stdout.readline, ""):
            lines.append(line)
            if marker in line and not seen_at:
                seen_at.append(time.monotonic())

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        release_shm(cmd)
    ended = time.monotonic()
    thread.join(timeout=10)
    return proc.returncode, "".join(lines), (ended - seen_at[0]) if seen_at else None


def metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """A finished run's training and evaluation records; every entry it wrote is one its ``run.json`` lists (what
    ``--overwrite_output_dir`` may remove: a writer that lists nothing would make its files undeletable)."""
    unlisted = set(os.listdir(out)) - set(json.loads((out / "run.json").read_text())["writes"])
    assert not unlisted, f"{out} holds {sorted(unlisted)}, which its run.json does not list"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x], [x for x in lines if "eval_loss" in x]


def processes_mentioning(token: str) -> list[str]:
    """Command lines of live processes that mention ``token`` (orphan detection)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found
