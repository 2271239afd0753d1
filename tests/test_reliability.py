"""Faults, exact resume, atomic checkpoints, non-finite steps — real 2-rank jobs via the deepspeed launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import deepspeed_cmd, metrics, pretrain_args, processes_mentioning, run, run_timed
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
TWO = ("--num_gpus", "2")


def last_samples_by_step(out: Path, rank: int) -> dict[int, list]:
    rows = [json.loads(x) for x in (out / "samples" / f"rank{rank}.jsonl").read_text().splitlines()]
    return {row["step"]: row["indices"] for row in rows}  # a step redone after a resume overrides


@pytest.mark.timeout(150)
@pytest.mark.parametrize("action", ["kill", "raise"])
def test_failed_rank_stops_the_job_within_60s_naming_it(tmp_path, cache_dir, action):
    out = tmp_path / action
    code, output, seconds = run_timed(
        deepspeed_cmd(*TWO, *pretrain_args(out, cache_dir, "--max_steps", "50", "--eval_every", "0")),
        timeout=140,
        marker="fault injection",
        DS_BERTOPT_FAULT=f"{action}@forward:rank=1:step=3",
    )
    assert code != 0
    assert seconds is not None and seconds < 60, output[-3000:]
    named = ("--local_rank=1" in output and "exits with return code" in output) or "rank 1 (pid" in output
    assert named, output[-3000:]
    if action == "raise":
        assert "injected failure at forward of step 3" in output
    assert not processes_mentioning(str(out)), "orphan processes left behind"
    print(f"{action}: job exited {seconds:.1f} s after the fault")


@pytest.mark.timeout(400)
def test_resume_after_kill_is_bit_exact(tmp_path, cache_dir):
    extra = (
        "--max_steps",
        "8",
        "--save_every",
        "2",
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "-o",
        "train.log_samples=true",
        "-o",
        "data.max_documents=60",
    )
    ref, cut = tmp_path / "uninterrupted", tmp_path / "interrupted"
    run(deepspeed_cmd(*TWO, *pretrain_args(ref, cache_dir, *extra)), 200)
    killed = run(
        deepspeed_cmd(*TWO, *pretrain_args(cut, cache_dir, *extra)),
        200,
        check=False,
        DS_BERTOPT_FAULT="kill@forward:rank=1:step=6",
    )
    assert killed.returncode != 0
    assert (cut / "checkpoints" / "latest").read_text() == "step00000004"
    resumed = run(deepspeed_cmd(*TWO, *pretrain_args(cut, cache_dir, *extra, "--resume")), 200)
    assert "resumed from step00000004: step 4" in resumed.stdout

    a, b = load_file(ref / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), f"{key} differs after resume"
    ref_loss = {m["step"]: m["loss"] for m in metrics(ref)[0]}
    cut_loss = {m["step"]: m["loss"] for m in metrics(cut)[0]}  # later lines (after resume) win
    assert [cut_loss[s] for s in range(1, 9)] == [ref_loss[s] for s in range(1, 9)]
    for rank in (0, 1):  # the same samples, in the same steps, on the same ranks
        assert last_samples_by_step(cut, rank) == last_samples_by_step(ref, rank)
    seen = [i for r in (0, 1) for step in last_samples_by_step(cut, r).values() for mb in step for i in mb]
    assert len(seen) == len(set(seen)), "a sample was used twice within the epoch"


@pytest.mark.timeout(400)
def test_crash_mid_checkpoint_and_corrupt_latest_fall_back(tmp_path, cache_dir):
    out = tmp_path / "run"
    extra = ("--max_steps", "6", "--save_every", "2", "--eval_every", "0", "-o", "data.max_documents=60")
    died = run(
        deepspeed_cmd(*TWO, *pretrain_args(out, cache_dir, *extra)),
        200,
        check=False,
        DS_BERTOPT_FAULT="kill@save:rank=1:step=4",
    )
    assert died.returncode != 0
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step00000002"
    assert (root / "step00000002" / "COMPLETE.json").exists()
    assert not (root / "step00000004").exists()  # only its .partial directory, never loaded

    resumed = run(deepspeed_cmd(*TWO, *pretrain_args(out, cache_dir, *extra, "--resume")), 200)
    assert "resumed from step00000002: step 2" in resumed.stdout
    assert (root / "latest").read_text() == "step00000006"

    # Now break the newest two ways: 'latest' names a checkpoint that is not there, and the newest
    # complete checkpoint's model file is truncated. Resume must fall back to step 4 and say so.
    (root / "latest").write_text("step00000099")
    model_file = root / "step00000006" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    again = run(deepspeed_cmd(*TWO, *pretrain_args(out, cache_dir, *extra[:1], "8", *extra[2:], "--resume")), 200)
    assert "falling back to the newest complete checkpoint step00000006" in again.stdout
    assert "checkpoint step00000006 could not be loaded" in again.stdout
    assert "resumed from step00000004: step 4" in again.stdout
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [
        "step00000004",
        "step00000006",
        "step00000008",
    ]  # keep_last 3


@pytest.mark.timeout(300)
def test_nonfinite_steps_are_skipped_then_abort(tmp_path, cache_dir):
    out = tmp_path / "nan"
    proc = run(
        deepspeed_cmd(
            *TWO, *pretrain_args(out, cache_dir, "--max_steps", "5", "--log_every", "1", "--eval_every", "0")
        ),
        200,
        DS_BERTOPT_FAULT="nan@loss:rank=0:step=3",
    )
    assert "step 3: skipped, gradients not finite" in proc.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x.get("skipped") is True] == [3]
    lr = {x["step"]: x["lr"] for x in lines if "lr" in x}
    assert lr[3] == lr[2] and lr[4] < lr[3]  # the schedule did not advance on the skipped step
    final = load_file(out / "final" / "model.safetensors")
    assert all(t.isfinite().all() for t in final.values())

    out2 = tmp_path / "nan_forever"
    proc = run(
        deepspeed_cmd(
            *TWO,
            *pretrain_args(
                out2, cache_dir, "--max_steps", "20", "--eval_every", "0", "-o", "train.max_consecutive_nonfinite=3"
            ),
        ),
        200,
        check=False,
        DS_BERTOPT_FAULT="nan@loss:rank=1:step>=2",
    )
    assert proc.returncode != 0
    assert "3 consecutive steps had non-finite gradients (steps 2-4); stopping" in proc.stdout + proc.stderr
