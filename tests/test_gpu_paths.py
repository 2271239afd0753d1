"""Each GPU-only defect found by reading our code beside DeepSpeed 0.19.8 and torch 2.13 (issue 27), shown on the
CPU where the CPU can show it. The whole matrix of wrappers a CUDA run gets is in ``test_gpu_conformance.py``."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from _launch import deepspeed_cmd, pretrain_args, run

from ds_bertopt import config
from ds_bertopt.comm.scaling import loss_scale_reader
from ds_bertopt.compat import deepspeed as ds_compat
from ds_bertopt.compat.deepspeed import register_as_producer, wait_for_bucket_producers
from ds_bertopt.config import apply_precision
from ds_bertopt.engine import _as_run_config, prepare_deepspeed_config
from ds_bertopt.errors import ConfigError
from ds_bertopt.testing.gpu_paths import Row, conformance_problems, gradient_part

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bert_json_first_bf16_step_with_the_cuda_optimizer(tmp_path, cache_dir):
    """bert.json in bf16 with the optimizer a CUDA host builds: DeepSpeed wraps FusedAdam in the fused
    FP16_Optimizer, whose loss_scale is None under bf16; the bucket clip read it as a number (TypeError)."""
    overrides = ("--max_steps", "2", "--eval_every", "0", "-o", "train.precision=bf16")
    args = pretrain_args(tmp_path / "run", cache_dir, *overrides)[1:]  # our script in place of launch/pretrain.py
    launcher = ("--num_gpus", "2", "--master_port", "29631", "tests/scripts/cuda_choice_pretrain.py")
    proc = run(deepspeed_cmd(*launcher, *args), 300)
    assert "AdamW: DeepSpeed FusedAdam" in proc.stdout and "(FP16_Optimizer:" in proc.stdout, proc.stdout[-3000:]
    assert "FP16_Optimizer: its state-creating zero-gradient step no longer counts" in proc.stdout
    assert "unpadded attention: exact per-sequence SDPA loop (cpu, bfloat16" in proc.stdout
    assert "done: 2 steps" in proc.stdout


def test_a_loss_scale_of_none_means_one_outside_fp16():
    fused_bf16 = SimpleNamespace(loss_scale=None)  # FP16_Optimizer._get_loss_scale without grad scaling
    assert loss_scale_reader(fused_bf16, fp16=False)() == 1.0
    fp16 = SimpleNamespace(loss_scale=65536.0)
    assert loss_scale_reader(fp16, fp16=True)() == 65536.0
    assert loss_scale_reader(SimpleNamespace(loss_scale=1.0), fp16=False)() == 1.0


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for {event.name}")


class _Event:
    count = 0

    def __init__(self, log):
        _Event.count += 1
        self.name, self.log = f"event{_Event.count}", log

    def record(self, stream):
        self.log.append(f"{self.name} recorded on {stream.name}")


class _StreamingAccelerator:
    """The stream API ``DeepSpeedZeroOptimizer`` uses, recording what is ordered after what (CUDA-like)."""

    def __init__(self):
        self.log = []
        self.stream = _Stream("current", self.log)

    def resolves_data_dependency(self):
        return False

    def current_stream(self):
        return self.stream

    def Event(self):  # noqa: N802 - DeepSpeed's accelerator API
        return _Event(self.log)


@pytest.mark.parametrize("offload", [False, True])
def test_the_reduction_waits_for_the_clip_with_and_without_offload(offload):
    """average_tensor waits on bucket.copy_streams (overlap_comm) or, with ZeRO-Offload, on bucket.ready_events
    only, recorded when the gradients were copied, before the clip: the clip must register in both."""
    accelerator = _StreamingAccelerator()
    copy_stream, copy_event = _Stream("copy", accelerator.log), _Event(accelerator.log)
    # compat.ipg_bucket hands the events on only where DeepSpeed's reduction waits on them (ZeRO-Offload)
    bucket = SimpleNamespace(copy_streams={copy_stream}, ready_events={copy_stream: copy_event} if offload else None)
    current = wait_for_bucket_producers(bucket, accelerator)
    accelerator.log.append("clip")
    register_as_producer(bucket, accelerator, current)
    log = accelerator.log
    assert log.index("current waits for copy") < log.index("clip") and current in bucket.copy_streams
    if offload:
        assert log.index(f"current waits for {copy_event.name}") < log.index("clip")
        event = bucket.ready_events[current]
        assert log.index(f"{event.name} recorded on current") > log.index("clip"), log
    on_cpu = SimpleNamespace(resolves_data_dependency=lambda: True)
    assert wait_for_bucket_producers(bucket, on_cpu) is None  # the CPU orders everything itself


def test_bucket_clip_turns_off_deepspeeds_default_clipping_too():
    """DeepSpeed 0.19.8 clips at 1.0 when gradient_clipping is absent (GRADIENT_CLIPPING_DEFAULT); the bucket clip
    refused such configs at install instead of switching it off."""
    run_config = _as_run_config({"train_micro_batch_size_per_gpu": 2, "bertopt": {"bucket_clip": {"enabled": True}}})
    assert prepare_deepspeed_config(run_config, 2, "cpu")["gradient_clipping"] == 0.0


def test_the_makefile_leaves_the_accelerator_to_the_host():
    """`make pretrain` on a GPU host trained on the CPU: the Makefile exported DS_ACCELERATOR=cpu."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    make = subprocess.run(["make", "-p", "-n", "pretrain"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert make.returncode == 0, make.stderr
    assert not [line for line in make.stdout.splitlines() if line.startswith("DS_ACCELERATOR")]


V100, A100 = ("Tesla V100-SXM2-32GB", (7, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))


def test_auto_precision_wants_native_bf16_on_the_bound_gpu(monkeypatch):
    """A V100/T4 answers is_bf16_supported() True by emulation; auto must pick fp16 there (the device stubbed at the
    one seam that asks it, config.cuda_capability)."""
    monkeypatch.setattr(config, "cuda_capability", lambda: V100)
    assert apply_precision({}, "auto", "cuda") == (
        "fp16",
        "train.precision auto: this GPU has no native bf16 (Tesla V100-SXM2-32GB (compute capability 7.0) would "
        "emulate it, many times slower)",
    )
    monkeypatch.setattr(config, "cuda_capability", lambda: A100)
    assert apply_precision({}, "auto", "cuda")[0] == "bf16"


@pytest.mark.parametrize(
    "ds, precision, key",
    [
        ({"bf16": {"enabled": True}}, "auto", "deepspeed.bf16.enabled"),  # the block wins over auto
        ({"bf16": {"enabled": True}}, "fp32", "deepspeed.bf16.enabled"),
        ({}, "bf16", "train.precision"),
    ],
)
def test_bf16_asked_for_by_name_on_a_gpu_that_emulates_it_is_refused_in_one_line(monkeypatch, ds, precision, key):
    monkeypatch.setattr(config, "cuda_capability", lambda: V100)
    with pytest.raises(ConfigError) as caught:
        apply_precision(dict(ds), precision, "cuda")
    message = str(caught.value)
    assert message.startswith(f"{key}: bf16 on Tesla V100-SXM2-32GB (compute capability 7.0)") and "\n" not in message
    assert "fp16" in message.split("use fp16:")[1]
    monkeypatch.setattr(config, "cuda_capability", lambda: A100)
    assert apply_precision(dict(ds), precision, "cuda")[0] == "bf16"
    monkeypatch.setattr(config, "cuda_capability", lambda: None)  # `ds-bertopt config --device cuda` with no GPU here
    assert apply_precision(dict(ds), precision, "cuda")[0] == "bf16"


GPU_CONFIGS_WITH_THE_BF16_BLOCK = ("bert_large_adam.json", "bert_large_lamb.json", "mlperf_bert_large.json")


@pytest.mark.parametrize("name", GPU_CONFIGS_WITH_THE_BF16_BLOCK)
def test_shipped_gpu_configs_with_the_bf16_block_are_refused_on_a_t4_and_run_on_an_a100(monkeypatch, name):
    from ds_bertopt.config import load_config

    path = os.path.join(REPO_ROOT, "ds_configs", name)
    assert load_config(path).deepspeed.get("bf16") == {"enabled": True}
    monkeypatch.setattr(config, "cuda_capability", lambda: ("Tesla T4", (7, 5)))
    with pytest.raises(ConfigError, match=r"^deepspeed\.bf16\.enabled: bf16 on Tesla T4 \(compute capability 7\.5\)"):
        prepare_deepspeed_config(load_config(path), 1024, "cuda")
    monkeypatch.setattr(config, "cuda_capability", lambda: A100)
    zero0 = load_config(path).deepspeed.get("zero_optimization", {}).get("stage", 0) == 0
    if zero0 and not ds_compat.available("engine.bf16_zero0"):  # DeepSpeed < 0.18: refused in one line (compat.md)
        with pytest.raises(ds_compat.DeepSpeedIncompatible, match=r"hook engine\.bf16_zero0 .*known to work with"):
            prepare_deepspeed_config(load_config(path), 1024, "cuda")
        return
    assert prepare_deepspeed_config(load_config(path), 1024, "cuda")["bf16"] == {"enabled": True}


def test_the_hf_trainer_refuses_emulated_bf16_too(monkeypatch):
    from ds_bertopt.integrations.hf import check_compatibility, load_bertopt

    monkeypatch.setattr(config, "cuda_capability", lambda: V100)
    args = SimpleNamespace(bf16=True, use_cpu=False)
    with pytest.raises(ConfigError, match=r"^TrainingArguments\.bf16: bf16 on Tesla V100"):
        check_compatibility(load_bertopt({}), None, args)
    check_compatibility(load_bertopt({}), None, SimpleNamespace(bf16=False, fp16=True, use_cpu=False))


def test_the_conformance_check_sees_an_update_made_of_weight_decay_alone():
    """apex's LAMB with the 0.0 bound moved the weights by −lr·w (decay alone), and `moved > 1e-4` passed it."""
    torch.manual_seed(0)
    before = {"w": torch.randn(8, 8), "b": torch.zeros(8), "ln": torch.ones(8)}
    decay_only = {n: w * (1 - 0.01) for n, w in before.items()}
    trained = {n: w - 0.01 * torch.randn_like(w).sign() for n, w in before.items()}
    assert gradient_part(before, decay_only) < 1e-4 and gradient_part(before, trained) > 0.5
    row = Row("bf16", "lamb", 0, apex=True)
    result = {
        "optimizer": "FusedLAMB", "wrapper": "FP16_UnfusedOptimizer", "step1_applied": True, "step2_applied": True,
        "clip_coefficients": [0.1], "nan_applied": False, "changed_by_nan_step": 0.0, "recovered_applied": True,
        "recovered_finite": True, "resumed_step": 1, "resumed_step2_applied": True, "resume_difference": 0.0,
    }  # fmt: skip
    for after, ok in ((decay_only, False), (trained, True)):
        figures = {**result, "moved": max_difference(after, before), "moved_by_gradients": gradient_part(before, after)}
        problems = conformance_problems(row, figures)
        assert (not problems) == ok, problems


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_main_binds_the_gpu_before_the_preflight_asks_it_anything(monkeypatch):
    """The pre-flight's precision check queries the current CUDA device: every rank asked GPU 0."""
    from ds_bertopt.errors import BertOptError
    from ds_bertopt.train import loop
    from ds_bertopt.train.tasks import PretrainTask

    calls = []
    monkeypatch.setattr(loop.dist, "bind_device", lambda topo, accelerator: calls.append("bind"))

    def preflight(*args, **kwargs):
        calls.append("preflight")
        raise BertOptError("stop here")

    monkeypatch.setattr(loop, "preflight", preflight)
    assert loop.main(PretrainTask(), ["--deepspeed_config", "ds_configs/bert.json"]) == 2
    assert calls == ["bind", "preflight"]


def test_the_varlen_probe_runs_when_the_model_is_placed_never_inside_a_forward(monkeypatch):
    """The probe ran lazily inside the first forward (with a backward, under activation checkpointing), and a
    failure there kept the SDPA loop for the whole run; now it runs in choose_attention and is logged."""
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.model import unpadded

    probes = []
    monkeypatch.setattr(unpadded, "varlen_supported", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(unpadded, "_VARLEN_PROBES", {})

    def probe(device, dtype, head_dim, with_dropout, windowed=False):
        probes.append((with_dropout, torch.is_grad_enabled()))
        return False  # as if flash varlen failed here: the loop is chosen, and said

    monkeypatch.setattr(unpadded, "probe_varlen", probe)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    model = unpadded.UnpaddedBert(BertForMaskedLM(config))
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    line = model.choose_attention()
    assert sorted(p[0] for p in probes) == [False, True]  # with and without attention dropout, before any forward
    assert line == "unpadded attention: exact per-sequence SDPA loop (cpu, float32, head_dim 8)"
    ids = torch.randint(5, 50, (12,))
    batch = dict(
        input_ids=ids,
        token_type_ids=torch.zeros_like(ids),
        position_ids=torch.cat([torch.arange(5), torch.arange(7)]),
        cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32),
        labels=torch.where(torch.arange(12) % 3 == 0, ids, torch.full_like(ids, -100)),
    )
    model.train()
    model(**batch).loss.backward()
    assert len(probes) == 2, "the forward probed again"


def _vote_without_reading_back(rank, world_size):
    """Two votes in a row, as the loop casts them; ``.item()``/``.tolist()`` raise, as a host sync in the step would."""
    import torch as t

    from ds_bertopt.train.loop import StopVote

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync in the stop vote")

    t.Tensor.item, t.Tensor.tolist = forbidden, forbidden
    quiet = StopVote(False, t.device("cpu"))
    wish = StopVote(rank == 1, t.device("cpu"))  # only rank 1 wants to stop
    return quiet.result(), wish.result()


def test_the_stop_vote_reaches_every_rank_without_item():
    """The loop's stop flag was read with ``previous_flag.item()``: on CUDA a wait for the whole step queued since."""
    from ds_bertopt.testing.distributed import spawn_ranks

    assert spawn_ranks(_vote_without_reading_back, 2, timeout=120) == [(False, True), (False, True)]
