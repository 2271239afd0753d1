"""The user's command, end to end: `deepspeed launch/pretrain.py --deepspeed_config ds_configs/bert.json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _launch import deepspeed_cmd, metrics, run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_two_rank_pretraining_checkpoint_and_resume(repo_root, tmp_path, cache_dir):
    out = tmp_path / "run"
    common = [
        "launch/pretrain.py",
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--output_dir",
        str(out),
        "--eval_every",
        "10",
        "--log_every",
        "2",
        "-o",
        f"data.cache_dir={cache_dir}",
        "-o",
        "data.max_documents=150",
    ]
    proc = run(deepspeed_cmd("--num_gpus", "2", *common, "--max_steps", "10", "--save_every", "5"), 300)
    assert "world 2 (1 node(s) × 2)" in proc.stdout
    train, evals = metrics(out)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert [e["step"] for e in evals] == [0, 10] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000010"
    assert {p.name for p in ckpt.iterdir()} >= {"step00000005", "step00000010"}
    assert json.loads((ckpt / "step00000010" / "COMPLETE.json").read_text())["step"] == 10
    assert (out / "final" / "model.safetensors").exists()

    proc = run(deepspeed_cmd("--num_gpus", "2", *common, "--max_steps", "14", "--resume"), 300)
    assert "resumed from step00000010: step 10" in proc.stdout
    train, evals = metrics(out)
    steps = [t["step"] for t in train]
    assert steps[-2:] == [12, 14] and steps.count(10) == 1  # continued, not restarted
    assert (ckpt / "latest").read_text() == "step00000014"


@pytest.mark.shared_data
@pytest.mark.timeout(300)
def test_bare_command_trains_on_wikipedia(repo_root, tmp_path, cache_dir, shared_data):
    out = tmp_path / "wiki"
    proc = run(
        deepspeed_cmd(
            "launch/pretrain.py",
            "--deepspeed_config",
            "ds_configs/bert.json",
            "--train_file",
            str(shared_data / "wiki_sample.jsonl"),
            "--max_steps",
            "6",
            "--eval_every",
            "6",
            "--log_every",
            "2",
            "--output_dir",
            str(out),
            "-o",
            f"data.cache_dir={cache_dir}",
            "-o",
            "data.max_documents=30",
        ),
        240,
    )
    assert "wiki_sample.jsonl" in proc.stdout and "world 1" in proc.stdout
    train, evals = metrics(out)
    assert train[-1]["loss"] < train[0]["loss"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


@pytest.mark.timeout(120)
def test_bad_config_fails_fast_with_one_line(repo_root, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bertopt": {"train": {"max_step": 3}}}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "launch/pretrain.py", "--deepspeed_config", str(bad)],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        "[ds_bertopt] error: bertopt.train: unknown key 'max_step' (did you mean 'max_steps'?); "
        "known keys: " + errors[0].split("known keys: ")[1]
    ]


@pytest.mark.timeout(300)
def test_dataloader_workers_and_the_unpadded_path_train_the_same_steps(repo_root, tmp_path, cache_dir):
    """Collating (and masking) in DataLoader worker processes gives exactly the steps of in-process collation:
    every micro-batch is seeded by its own (seed, epoch, step, micro-batch, rank). bert.json trains unpadded on
    packed batches, so both runs take the unpadded path."""
    common = (
        "launch/pretrain.py",
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--max_steps",
        "4",
        "--eval_every",
        "0",
        "--log_every",
        "1",
        "-o",
        f"data.cache_dir={cache_dir}",
        "-o",
        "data.max_documents=60",
        "-o",
        "train.save_model=false",
        "-o",
        'train.precision="fp32"',
    )
    losses = {}
    for name, extra in (
        ("inline", ()),
        ("workers", ("-o", "train.dataloader_workers=2")),
    ):
        out = tmp_path / name
        proc = run(deepspeed_cmd(*common, "--output_dir", str(out), *extra), 240)
        losses[name] = [m["loss"] for m in metrics(out)[0]]
        assert "unpadded attention" in proc.stdout and "(packed_node_balance)" in proc.stdout, proc.stdout[-3000:]
    assert losses["workers"] == losses["inline"] and len(losses["inline"]) == 4
    assert all(loss == loss and loss < 20 for loss in losses["inline"])
