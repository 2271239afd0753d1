"""The pre-flight is the whole gate: any config it accepts gets through ``deepspeed.initialize`` and trains
a step; ``ds-bertopt config`` runs exactly the same pre-flight and answers bad input in one line, including
a key the task does not read."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from _launch import FULL_MATRIX

from ds_bertopt.cli import main as cli_main
from ds_bertopt.dist import Topology
from ds_bertopt.errors import BertOptError
from ds_bertopt.testing.distributed import spawn_ranks
from ds_bertopt.train.preflight import unread_keys
from ds_bertopt.train.tasks import FinetuneTask

CONFIG = "ds_configs/bert.json"
WORLD = 2


def _random_overrides(rng: random.Random) -> list[str]:
    """A random mix of the options that interact: ZeRO stage, optimizer, bucket clip, precision, batch shape."""
    stage = rng.choice([0, 1, 2, 3])
    overrides = [
        f"deepspeed.zero_optimization.stage={stage}",
        f'optimizer.type="{rng.choice(["adamw", "lamb"])}"',
        f"bucket_clip.enabled={rng.choice(['true', 'false'])}",
        f'train.precision="{rng.choice(["fp32", "bf16", "auto"])}"',
        f"deepspeed.train_micro_batch_size_per_gpu={rng.choice([1, 2, 3])}",
        f"deepspeed.gradient_accumulation_steps={rng.choice([1, 2])}",
        f"deepspeed.gradient_clipping={rng.choice([0.0, 1.0])}",
        f'schedule.type="{rng.choice(["poly", "cosine", "constant"])}"',
    ]
    if rng.random() < 0.3:
        overrides.append(f"deepspeed.train_batch_size={rng.choice([4, 6, 8, 12])}")
    if rng.random() < 0.3:
        overrides.append("deepspeed.zero_optimization.overlap_comm=true")
    if rng.random() < 0.2:  # the block sets the precision: train.precision beside it would be a dead key
        overrides = [o for o in overrides if not o.startswith("train.precision")]
        overrides.append('deepspeed.bf16={"enabled": true}')
    return overrides + [
        "train.max_steps=3",
        "model.hidden_size=16",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=32",
        "train.eval_every=0",
    ]


def _initialize_and_step(rank: int, world_size: int, overrides: list[str]) -> float:
    """One accepted config in fresh ranks (as a job runs it): the real ``deepspeed.initialize``, then one step."""
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt import optim
    from ds_bertopt.engine import initialize
    from ds_bertopt.model import SparseMLMHead
    from ds_bertopt.train.preflight import preflight, with_total_steps
    from ds_bertopt.train.tasks import PretrainTask

    topo = Topology(rank=rank, world_size=world_size, local_rank=rank, ranks_per_node=world_size, node_rank=0)
    cfg = with_total_steps(preflight(PretrainTask(), CONFIG, overrides, topo, "cpu").cfg, 3)
    torch.distributed.barrier()  # as the launcher's rendezvous does: no rank writes before all passed the pre-flight
    ds = cfg.deepspeed
    torch.manual_seed(0)
    model = SparseMLMHead(
        BertForMaskedLM(
            BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
        )
    )
    optimizer, scheduler = optim.build(
        model,
        cfg.bertopt,
        global_batch=ds["train_batch_size"],
        zero_stage=int(ds.get("zero_optimization", {}).get("stage", 0)),
    )
    engine, *_ = initialize(config=cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(ds["gradient_accumulation_steps"]):
        ids = torch.randint(5, 40, (ds["train_micro_batch_size_per_gpu"], 8), generator=gen)
        labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]
        out = engine(
            input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids), labels=labels
        )
        engine.backward(out.loss)
        engine.step()
    return float(out.loss)


@pytest.mark.timeout(900)
def test_any_config_the_preflight_accepts_initializes_and_steps(tmp_path):
    """Random mixes of the interacting options: the pre-flight (no ranks needed) refuses some; every one it
    accepts gets through the real ``deepspeed.initialize`` on 2 gloo ranks and takes a finite step."""
    from ds_bertopt.train.preflight import preflight
    from ds_bertopt.train.tasks import PretrainTask

    topo = Topology(rank=0, world_size=WORLD, local_rank=0, ranks_per_node=WORLD, node_rank=0)
    accepted, refused = [], []
    for seed in range(14 if FULL_MATRIX else 8):  # 8: stages 0-2, both optimizers, fp32 and bf16, 3 refusals
        overrides = _random_overrides(random.Random(seed)) + [f'train.output_dir="{tmp_path}/{seed}"']
        try:
            preflight(PretrainTask(), CONFIG, overrides, topo, "cpu")
            accepted.append(overrides)
        except BertOptError as exc:
            refused.append(str(exc))
    assert len(accepted) >= 4 and len(refused) >= 2, (accepted, refused)  # both sides of the gate exercised
    for overrides in accepted:
        losses = spawn_ranks(_initialize_and_step, WORLD, overrides, timeout=280)
        assert all(math.isfinite(loss) for loss in losses), overrides


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (
            [
                "-o",
                'optimizer.type="lamb"',
                "-o",
                "deepspeed.zero_optimization.stage=3",
                "-o",
                'deepspeed.bf16={"enabled": true}',
            ],
            '"lamb" is not supported under ZeRO stage 3',
        ),
        (["-o", "deepspeed.bf16=true"], "deepspeed.bf16: expected an object"),
        (["-o", "deepspeed.zero_optimization.stag=2"], "deepspeed.zero_optimization: unknown key 'stag'"),
        (["--world-size", "3"], "train_batch_size"),  # bert.json's batch does not divide 3 ranks? it does: see below
    ],
)
def test_config_command_runs_the_preflight(capsys, tmp_path, argv, fragment):
    code = cli_main(["config", CONFIG, "--output_dir", str(tmp_path / "new"), *argv])
    captured = capsys.readouterr()
    if fragment == "train_batch_size":  # a valid config: the resolved JSON is printed
        assert code == 0 and json.loads(captured.out)["deepspeed"]["train_batch_size"] == 48
        return
    lines = [line for line in captured.err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], captured.err
    assert not (tmp_path / "new").exists()


def test_config_command_checks_the_task_inputs(capsys, tmp_path):
    code = cli_main(
        [
            "config",
            "--task",
            "finetune",
            "ds_configs/finetune_zero0.json",
            "--train_file",
            str(tmp_path / "missing.csv"),
            "--output_dir",
            str(tmp_path / "new"),
        ]
    )
    assert code == 2 and "missing.csv does not exist" in capsys.readouterr().err


def test_unread_keys_are_refused_in_one_line(capsys, tmp_path):
    """Silently wrong before: pretraining with wtacrs.enabled, fine-tuning with model.* and data.* keys ran, and
    ignored them."""
    cases = [
        (
            ["ds_configs/bert.json", "-o", "wtacrs.enabled=true"],
            "bertopt.wtacrs.enabled: pretraining does not read it (WTA-CRS and the memory kit are for fine-tuning, "
            "launch/finetune.py); remove it, or set train.allow_unread_keys=true to accept keys this task ignores",
        ),
        (
            ["--task", "finetune", "ds_configs/finetune_zero0.json", "-o", "model.unpadded=true"]
            + ["-o", "model.hidden_size=64", "-o", "data.max_seq_length=512"],
            "bertopt.data.max_seq_length: fine-tuning does not read it (its data settings are finetune.*, e.g. "
            "finetune.train_file, finetune.max_seq_length) (and 1 more: model.hidden_size)",
        ),
    ]
    for argv, fragment in cases:
        code = cli_main(["config", *argv, "--output_dir", str(tmp_path / "new")])
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert code == 2 and len(lines) == 1 and fragment in lines[0], lines
    # the escape hatch: accepted, and named
    out = ["--output_dir", str(tmp_path / "new")]
    code = cli_main(
        ["config", CONFIG, "-o", "wtacrs.enabled=true", "--train.allow_unread_keys", "--max_steps", "3", *out]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "note: pretraining does not read bertopt.wtacrs.enabled (train.allow_unread_keys)" in captured.err
    # fine-tuning reads data.max_skipped_fraction (its labelled rows are capped the same way)
    assert unread_keys({"data.max_skipped_fraction", "finetune.train_file"}, FinetuneTask.reads) == []


def test_packed_planning_for_a_padded_model_gets_a_note(capsys, tmp_path):
    out = ["--output_dir", str(tmp_path / "new")]
    assert cli_main(["config", CONFIG, "-o", "model.unpadded=false", *out]) == 0
    err = capsys.readouterr().err
    assert "note: sampler.strategy packed_node_balance balances real tokens, for kernels that skip padding" in err
    assert cli_main(["config", CONFIG, *out]) == 0  # bert.json: unpadded, no note
    assert "packed_node_balance balances" not in capsys.readouterr().err


def test_dead_keys_are_refused_and_a_command_line_switch_only_notes_the_files(capsys, tmp_path):
    """Silently ignored before: bucket_clip.* with bucket clip off, sampler.bins with the random strategy. Typed (or
    written in the file) beside the setting that kills them: one line. A file's key that this run's command-line
    switch kills (turning bert.json's bucket clip off): a note, and the run goes on."""
    out = ["--output_dir", str(tmp_path / "new")]
    cases = [
        (["-o", "bucket_clip.enabled=false", "-o", "bucket_clip.max_norm=2"], "bertopt.bucket_clip.max_norm: has no "),
        (["-o", 'sampler.strategy="random"', "-o", "sampler.bins=[64]"], "bertopt.sampler.bins: has no effect: "),
    ]
    for argv, fragment in cases:
        assert cli_main(["config", CONFIG, *argv, *out]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(lines) == 1 and fragment in lines[0], lines
    assert cli_main(["config", CONFIG, "-o", "bucket_clip.enabled=false", *out]) == 0
    assert (
        f"note: the command line makes {CONFIG}'s bertopt.bucket_clip.max_norm (bucket_clip.enabled is false) have no "
        "effect in this run" in capsys.readouterr().err
    )
