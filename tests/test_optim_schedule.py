"""LR schedule values, MLPerf's formula, LR scaling, scheduler state, config errors, build()."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds_bertopt.config import BertOptConfig, load_config
from ds_bertopt.configlib import load_section
from ds_bertopt.errors import ConfigError
from ds_bertopt.optim import Lamb, build, lr_multiplier, scale_lr
from ds_bertopt.optim.config import ScheduleConfig
from ds_bertopt.optim.schedule import build_lr_scheduler


def sched(**kw) -> ScheduleConfig:
    return load_section(ScheduleConfig, kw, "bertopt.schedule")


def test_poly_schedule_key_points():
    cfg = sched(type="poly", warmup_steps=10, power=2.0, end_lr_ratio=0.1)
    n = 110
    assert lr_multiplier(0, cfg, n) == pytest.approx(0.1)  # warmup start: first update already moves
    assert lr_multiplier(4, cfg, n) == pytest.approx(0.5)
    assert lr_multiplier(9, cfg, n) == pytest.approx(1.0)  # warmup end: peak
    assert lr_multiplier(10, cfg, n) == pytest.approx(1.0)  # decay starts at the peak
    assert lr_multiplier(60, cfg, n) == pytest.approx(0.1 + 0.9 * 0.5**2)  # mid-decay
    assert lr_multiplier(110, cfg, n) == pytest.approx(0.1)  # end
    assert lr_multiplier(500, cfg, n) == pytest.approx(0.1)  # stays there
    values = [lr_multiplier(k, cfg, n) for k in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_and_constant_schedules():
    cfg = sched(type="cosine", warmup_fraction=0.1, end_lr_ratio=0.0)
    assert lr_multiplier(9, cfg, 100) == pytest.approx(1.0)
    assert lr_multiplier(55, cfg, 100) == pytest.approx(0.5)
    assert lr_multiplier(100, cfg, 100) == pytest.approx(0.0, abs=1e-12)
    const = sched(type="constant", warmup_steps=4)
    assert [lr_multiplier(k, const, 50) for k in (0, 3, 4, 49)] == pytest.approx([0.25, 1.0, 1.0, 1.0])


def test_start_warmup_step_offsets_the_ramp():
    cfg = sched(warmup_steps=100, start_warmup_step=-25)
    assert lr_multiplier(0, cfg, 1000) == pytest.approx(26 / 100)
    assert lr_multiplier(74, cfg, 1000) == pytest.approx(1.0)  # warmup ends 25 steps early
    assert lr_multiplier(75, cfg, 1000) == pytest.approx(1.0)
    assert lr_multiplier(75 + (1000 - 75) // 2, cfg, 1000) == pytest.approx(0.5, abs=1e-3)


def mlperf_reference_lr(step, init_lr, num_train_steps, num_warmup_steps, poly_power, start_warmup_step):
    """MLPerf BERT's TF reference (optimization.create_optimizer), transcribed: polynomial decay of
    the global step, replaced by init_lr·(step − start)/warmup while that is below warmup."""
    decayed = init_lr * (1 - min(step, num_train_steps) / num_train_steps) ** poly_power
    ramp = step - start_warmup_step
    return init_lr * ramp / num_warmup_steps if ramp < num_warmup_steps else decayed


def test_step0_decay_matches_mlperf_reference():
    cfg = sched(warmup_steps=100, start_warmup_step=-25, power=1.0, decay_from="step0", decay_steps=1271)
    for step in (80, 300, 700, 1270, 1271):
        assert lr_multiplier(step, cfg, 5000) == pytest.approx(
            mlperf_reference_lr(step, 1.0, 1271, 100, 1.0, -25), rel=1e-9
        )
    # During warmup we read the ramp one step ahead (the first update is never at LR 0).
    for step in (0, 10, 50):
        assert lr_multiplier(step, cfg, 5000) == pytest.approx(
            mlperf_reference_lr(step + 1, 1.0, 1271, 100, 1.0, -25), rel=1e-9
        )


@pytest.mark.parametrize("rule, expected", [("linear", 0.004), ("sqrt", 0.001 * math.sqrt(4)), ("none", 0.001)])
def test_lr_scaling_arithmetic(rule, expected):
    cfg = sched(scaling=rule, reference_batch=None if rule == "none" else 256)
    assert scale_lr(0.001, 1024, cfg) == pytest.approx(expected)
    if rule != "none":
        assert scale_lr(0.001, 256, cfg) == pytest.approx(0.001)
        assert scale_lr(0.001, 64, cfg) == pytest.approx(0.001 * (0.25 if rule == "linear" else 0.5))


def test_scheduler_drives_group_lr_and_saves_only_counters():
    cfg = sched(warmup_steps=3, power=1.0)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [param]}], lr=0.5)
    scheduler = build_lr_scheduler(opt, cfg, max_steps=9)
    seen = []
    for _ in range(9):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.zeros(2)
        opt.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * lr_multiplier(k, cfg, 9) for k in range(9)])
    state = scheduler.state_dict()
    assert "multiplier" not in state and state["last_epoch"] == 9
    torch.save(state, "/dev/null")  # plain data only
    other = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5), cfg, max_steps=9)
    other.load_state_dict(state)
    other.step()
    assert other.get_last_lr() == pytest.approx([0.5 * lr_multiplier(10, cfg, 9)])


@pytest.mark.parametrize(
    "section, override, message",
    [
        ("schedule", "schedule.scaling=sqrt", "reference_batch: set it exactly when scaling"),
        ("schedule", "schedule.start_warmup_step=5", "start_warmup_step: must be <= 0"),
        ("schedule", "schedule.decay_from=end", "decay_from"),
        ("schedule", "schedule.warmup_step=3", "did you mean 'warmup_steps'"),
        ("optimizer", "optimizer.type=lars", "optimizer.type"),
        ("optimizer", "optimizer.bias_correction=false", "bias_correction: false is only supported with type"),
        ("optimizer", "optimizer.implementation=apex", "implementation: 'apex' is not one for type 'adamw'"),
        ("optimizer", "optimizer.betas=[0.9, 1.0]", "betas: must be in [0, 1)"),
    ],
)
def test_config_errors_name_the_key(tmp_path, section, override, message):
    path = tmp_path / "c.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "bertopt": {}}')
    with pytest.raises(ConfigError) as err:
        load_config(str(path), [override])
    assert f"bertopt.{section}" in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def _bertopt(**sections) -> BertOptConfig:
    return load_section(BertOptConfig, {"train": {"max_steps": 100}, **sections}, "bertopt")


def test_build_scales_lr_prints_it_and_returns_lamb(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = _bertopt(
        optimizer={"type": "lamb", "lr": 0.002, "max_grad_norm": 1.0},
        schedule={"scaling": "sqrt", "reference_batch": 256, "warmup_steps": 2},
        train={"max_steps": 10},
    )
    optimizer, scheduler = build(model, cfg, global_batch=1024, zero_stage=1)
    assert isinstance(optimizer, Lamb) and optimizer.max_grad_norm == 1.0
    assert [g["initial_lr"] for g in optimizer.param_groups] == pytest.approx([0.004, 0.004])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.002)  # step 0 of a 2-step warmup
    assert [g["adapt"] for g in optimizer.param_groups] == [True, False]
    out = capsys.readouterr().out
    assert "peak lr 0.004 at global batch 1024 = 0.002 at reference batch 256 scaled by the sqrt rule" in out


def test_build_turns_lamb_clipping_off_under_bucket_clip(capsys):
    model = torch.nn.Linear(3, 3)
    cfg = _bertopt(optimizer={"type": "lamb"}, bucket_clip={"enabled": True})
    optimizer, _ = build(model, cfg, global_batch=8, zero_stage=0)
    assert optimizer.max_grad_norm == 0.0
    assert "LAMB's own global-norm clipping (max_grad_norm 1) is off" in capsys.readouterr().out


def test_build_needs_the_run_length():
    with pytest.raises(ConfigError, match="train.max_steps: the learning-rate schedule needs the run's length"):
        build(torch.nn.Linear(3, 3), load_section(BertOptConfig, {}, "bertopt"), global_batch=8, zero_stage=0)


def test_build_refuses_lamb_under_zero3():
    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        build(torch.nn.Linear(3, 3), _bertopt(optimizer={"type": "lamb"}), global_batch=8, zero_stage=3)


def test_build_adamw_uses_torch_fused_on_cpu():
    optimizer, _ = build(
        torch.nn.Linear(3, 3), _bertopt(optimizer={"type": "adamw", "lr": 0.01}), global_batch=8, zero_stage=2
    )
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]


CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


@pytest.mark.parametrize(
    "name",
    ["bert_lamb.json", "bert_adam.json", "bert_large_lamb.json", "bert_large_adam.json", "mlperf_bert_large.json"],
)
def test_shipped_configs_load_and_fit_their_optimizer(name):
    """What DeepSpeed gets never clips twice: with the bucket clip or LAMB's own clip, its gradient_clipping is 0
    (also where the key is absent: DeepSpeed's default is 1.0); AdamW alone keeps DeepSpeed's."""
    from ds_bertopt.engine import prepare_deepspeed_config

    cfg = load_config(str(CONFIGS / name))
    ocfg = cfg.bertopt.optimizer
    assert ocfg.type == ("lamb" if "lamb" in name or "mlperf" in name else "adamw")
    world = 1024 if "train_batch_size" in cfg.deepspeed else 2
    ds = prepare_deepspeed_config(cfg, world, "cpu")
    clips_itself = cfg.bertopt.bucket_clip.enabled or ocfg.type == "lamb"
    assert ds.get("gradient_clipping", 1.0) == (0.0 if clips_itself else 1.0), ds.get("gradient_clipping")


def test_large_lamb_config_reproduces_mlperf_schedule():
    cfg = load_config(str(CONFIGS / "bert_large_lamb.json"))
    sched_cfg, steps = cfg.bertopt.schedule, cfg.bertopt.train.max_steps
    peak = scale_lr(cfg.bertopt.optimizer.lr, 3072, sched_cfg)
    assert peak == pytest.approx(1.5e-3)
    for step in (100, 640, 1270):
        assert peak * lr_multiplier(step, sched_cfg, steps) == pytest.approx(
            mlperf_reference_lr(step, 1.5e-3, 1271, 100, 1.0, -25)
        )
