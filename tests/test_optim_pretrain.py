"""``launch/pretrain.py`` under the real deepspeed launcher with the shipped LAMB / AdamW configs.

Checks that the optimizer and schedule come from the config at ZeRO 1 and 2: the logged LR of
every step is the peak (scaled by the sqrt rule) times ``lr_multiplier``, the loss falls, and LAMB
reports its layer-wise attachment. Uses the embedded corpus, so no shared data is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _launch import deepspeed_cmd

from ds_bertopt.testing.distributed import free_port
from ds_bertopt.config import load_config
from ds_bertopt.optim import lr_multiplier, scale_lr

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "data.max_documents=300",
    "data.tokenizer_vocab_size=1000",
    "train.save_model=false",
    "deepspeed.train_micro_batch_size_per_gpu=4",
    "deepspeed.csv_monitor.enabled=false",
]
STEPS = 8


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config, stage", [("bert_lamb.json", 2), ("bert_adam.json", 1)])
def test_pretrain_launcher_trains_with_config_optimizer(tmp_path, config, stage):
    launcher = deepspeed_cmd()[0]  # next to sys.executable: CI does not activate the venv
    overrides = TINY + [f"deepspeed.zero_optimization.stage={stage}", "train.log_every=1"]
    cmd = [
        launcher,
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "launch/pretrain.py",
        "--deepspeed_config",
        f"ds_configs/{config}",
        "--max_steps",
        str(STEPS),
        "--eval_every",
        "4",
        "--max_seq_length",
        "32",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    for text in overrides:
        cmd += ["-o", text]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cfg = load_config(
        str(ROOT / "ds_configs" / config),
        [o for o in overrides if not o.startswith("deepspeed.")] + ["train.max_steps=8"],
    )
    global_batch = 4 * 2
    peak = scale_lr(cfg.bertopt.optimizer.lr, global_batch, cfg.bertopt.schedule)
    assert f"peak lr {peak:.6g} at global batch {global_batch}" in proc.stdout
    if cfg.bertopt.optimizer.type == "lamb":
        assert f"layer-wise trust ratio over DeepSpeedZeroOptimizer (ZeRO {stage})" in proc.stdout
    else:
        assert "AdamW: torch (fused)" in proc.stdout

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # The engine reports the LR the next step will use: peak × multiplier(step).
    for record in train:
        assert record["lr"] == pytest.approx(peak * lr_multiplier(record["step"], cfg.bertopt.schedule, STEPS))
    evals = [r for r in records if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
