"""``ds_bertopt.initialize``: a drop-in for ``deepspeed.initialize`` that understands ``"bertopt"``.

It takes the same arguments as ``deepspeed.initialize`` (``config`` may be a path, a dict with a
``"bertopt"`` section, or a :class:`~ds_bertopt.config.RunConfig`), and:

1. resolves the batch triple for the current world size, sets the precision (refusing fp16 on CPU) and
   checks DeepSpeed's part with DeepSpeed's own parser (:mod:`ds_bertopt.dsconfig`),
2. turns DeepSpeed's ``gradient_clipping`` off when our bucket-clip hook replaces it (logged),
3. calls ``deepspeed.initialize`` with DeepSpeed's part of the config only,
4. installs the engine extensions the config asks for: the bucket-clip hook
   (:func:`ds_bertopt.comm.install_bucket_clip`) and any client optimizer that needs to see the
   engine: our LAMB (:func:`ds_bertopt.optim.zero.attach_lamb` keeps its trust ratio layer-wise under ZeRO 1/2),
   and the non-finite guard (:mod:`ds_bertopt.nonfinite`: a step with inf/NaN gradients is skipped at every
   precision and ZeRO stage; ``engine.was_step_applied()`` says so).

It returns DeepSpeed's 4-tuple unchanged in shape.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import torch

from .buildlocks import clear_stale_build_locks
from .compat.deepspeed import (
    check_release,
    fp16_wrapped_optimizer,
    fp16_wrapper_masters,
    needed_hooks,
    settle_engine,
)
from .comm import install_bucket_clip
from .comm.config import refuse_bucket_clip_under_zero3
from .config import BertOptConfig, RunConfig, apply_precision, load_config, resolve_batch
from .configlib import load_section
from .dsconfig import check_deepspeed_config, optimizer_offload, zero_stage
from .errors import ConfigError
from .log import print0
from .nonfinite import install_nonfinite_guard
from .optim import LAMB_OFFLOAD_REFUSAL
from .optim.lamb import Lamb
from .optim.zero import attach_lamb, refuse_lamb_under_zero3


def _as_run_config(config: Any) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str):
        return load_config(config)
    if isinstance(config, dict):
        raw = copy.deepcopy(config)
        ours = load_section(BertOptConfig, raw.pop("bertopt", {}), "bertopt")
        return RunConfig(path="<dict>", deepspeed=raw, bertopt=ours)
    raise TypeError(f"config must be a path, a dict or a RunConfig, got {type(config).__name__}")


def check_combinations(bertopt: BertOptConfig, ds: dict, our_optimizer: bool = True) -> None:
    """Refuse, before anything starts, feature combinations that cannot work together (the rows refused in the
    GPU conformance matrix of docs/gpu_matrix.md, in its order). Every entry point calls it: the launcher's pre-flight,
    ``ds-bertopt config`` and the Hugging Face integration (``our_optimizer`` False when the Trainer builds its
    own optimizer, so ``bertopt.optimizer`` is not applied)."""
    stage = zero_stage(ds)
    offload = optimizer_offload(ds)
    lamb = our_optimizer and bertopt.optimizer.type == "lamb"
    if lamb:
        refuse_lamb_under_zero3(stage)
    if offload and stage == 0:
        raise ConfigError(
            f"zero_optimization.offload_optimizer: device {offload!r} needs ZeRO stage 1, 2 or 3 (at stage 0 "
            "the optimizer stays on the accelerator); set zero_optimization.stage, or drop offload_optimizer"
        )
    if offload and lamb:
        raise ConfigError(LAMB_OFFLOAD_REFUSAL)
    if bertopt.bucket_clip.enabled:
        refuse_bucket_clip_under_zero3(stage)
    precision = next((p for p in ("fp16", "bf16") if (ds.get(p) or {}).get("enabled") is True), "fp32")
    accumulation = ds.get("gradient_accumulation_steps")
    shape = dict(
        stage=stage, precision=precision, bucket_clip=bertopt.bucket_clip.enabled, lamb=lamb, offload=offload == "cpu"
    )
    for note in check_release(needed_hooks(**shape, accumulation=accumulation if isinstance(accumulation, int) else 1)):
        print0(note)


def refuse_deepspeed_optimizer_blocks(ds: dict) -> None:
    """Our entry points build the optimizer and schedule from ``"bertopt"``; a DeepSpeed block
    would be silently overridden, so it is an error there (``initialize`` itself accepts it)."""
    for block in ("optimizer", "scheduler"):
        if block in ds:
            raise ConfigError(
                f'the DeepSpeed "{block}" block is not used by ds_bertopt\'s entry points; '
                'configure "bertopt": {"optimizer": ..., "schedule": ...} instead'
            )


# DeepSpeed monitor blocks and the package each imports when enabled (deepspeed/monitor/utils.py,
# check_tb_availability / check_wandb_availability): fail before initialize with one line, not a traceback.
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def check_monitor_packages(ds: dict) -> None:

    for block, package in MONITOR_PACKAGES.items():
        if (ds.get(block) or {}).get("enabled") and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"deepspeed.{block}: enabled but the '{package}' package is not installed "
                f"(pip install {package}, or -o deepspeed.{block}.enabled=false)"
            )


def prepare_deepspeed_config(cfg: RunConfig, world_size: int, device_type: str) -> dict:
    """DeepSpeed's part of ``cfg``, batch-resolved and adjusted for our extensions."""
    ds = resolve_batch(cfg.deepspeed, world_size)
    precision, why = apply_precision(ds, cfg.bertopt.train.precision, device_type)
    check_deepspeed_config(ds)  # DeepSpeed's own parser: unknown keys, typos in blocks, wrong types
    check_combinations(cfg.bertopt, ds)
    check_monitor_packages(ds)
    print0(f"precision: {precision} ({why})")
    if cfg.bertopt.bucket_clip.enabled:
        # an absent key is not "off": DeepSpeed 0.19 defaults it to 1.0 (GRADIENT_CLIPPING_DEFAULT; 0 before)
        clipping = ds.get("gradient_clipping", "1.0, DeepSpeed's default")
        if clipping:
            print0(
                f"bucket_clip is on: DeepSpeed's gradient_clipping ({clipping}) set to 0; "
                f"each rank clips each bucket to max_norm {cfg.bertopt.bucket_clip.max_norm} before allreduce"
            )
        ds["gradient_clipping"] = 0.0
    return ds


def initialize(*, config: Any, model, **kwargs):
    """Like ``deepspeed.initialize(config=..., model=..., ...)`` plus our ``"bertopt"`` extensions."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    run = _as_run_config(config)
    if not dist.is_initialized():
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            clear_stale_build_locks()  # DeepSpeed's process group builds its shm op first thing
        deepspeed.init_distributed(verbose=False)
    world = dist.get_world_size()
    if run.resolved_for == world:
        ds = copy.deepcopy(run.deepspeed)
    else:
        ds = prepare_deepspeed_config(run, world, get_accelerator().device_name())
    _allow_our_optimizer_under_zero(ds, kwargs.get("optimizer"))
    engine, optimizer, dataloader, scheduler = deepspeed.initialize(model=model, config=ds, **kwargs)
    attach_extensions(engine, run.bertopt)
    return engine, optimizer, dataloader, scheduler


def _allow_our_optimizer_under_zero(ds: dict, optimizer) -> None:
    """DeepSpeed's ZeRO 1/2 refuses client optimizers it has not tested unless told otherwise
    (``zero_allow_untested_optimizer``); our LAMB is made ZeRO-aware by :func:`attach_extensions`. ZeRO-Offload
    refuses any client optimizer but ``DeepSpeedCPUAdam`` (``zero_force_ds_cpu_optimizer``, read in
    ``DeepSpeedEngine._configure_optimizer``); ``ds_bertopt.optim`` builds torch's fused CPU AdamW for it."""
    stage = zero_stage(ds)
    if isinstance(optimizer, Lamb) and stage in (1, 2) and not ds.get("zero_allow_untested_optimizer"):
        print0(
            f"LAMB under ZeRO {stage}: zero_allow_untested_optimizer set to true "
            "(ds_bertopt keeps the trust ratio layer-wise)"
        )
        ds["zero_allow_untested_optimizer"] = True
    if optimizer is not None and optimizer_offload(ds) and "zero_force_ds_cpu_optimizer" not in ds:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if not isinstance(optimizer, DeepSpeedCPUAdam):
            print0(
                f"ZeRO-Offload with {type(optimizer).__name__} on the host: zero_force_ds_cpu_optimizer set to false"
            )
            ds["zero_force_ds_cpu_optimizer"] = False


def undo_state_initialising_step(engine) -> bool:
    """Give back the step DeepSpeed's fp16/bf16 wrappers at ZeRO 0 take to create the optimizer state.

    ``FP16_Optimizer.initialize_optimizer_states`` (what a CUDA run gets with ``FusedAdam``) and
    ``FP16_UnfusedOptimizer.initialize_optimizer_states`` (torch's AdamW, LAMB) step the optimizer once on all-zero
    gradients, in their ``__init__``, at the optimizer's construction lr. The moments stay zero, but

    * the step counters read 1, so every later step would use the bias correction of the step after it (the first
      real Adam update ≈ 0.74× what ZeRO 1/2 or fp32 take): set back to 0;
    * weight decay moved the fp32 master weights: decoupled decay shrinks them by ``1 − lr·λ`` (AdamW), and apex's
      LAMB by ``1 − lr`` (with zero gradients the update is ``λw`` and the trust ratio ``‖w‖/‖λw‖``): the masters are
      copied back from the model's 16-bit weights, which that step never touched and from which the wrapper had just
      made them (``fp16_groups_flat[i].clone().float()``, ``p.clone().float()``: exact).

    No other wrapper steps before training in DeepSpeed 0.19.8 (ZeRO 1/2/3 and ``BF16_Optimizer`` only zero their
    gradients). Returns whether there was anything to give back."""
    basic, reset = fp16_wrapped_optimizer(engine.optimizer), False
    if basic is None:
        return False
    with torch.no_grad():
        for master, weight in fp16_wrapper_masters(engine.optimizer):
            master.copy_(weight)
    for group in basic.param_groups:
        if group.get("step"):
            group["step"] = 0
            reset = True
        for param in group["params"]:
            state = basic.state.get(param) or {}
            step = state.get("step")
            if step is not None and bool(step != 0):
                state["step"] = torch.zeros_like(step) if torch.is_tensor(step) else 0
                reset = True
    return reset


def attach_extensions(engine, bertopt: BertOptConfig) -> None:
    """Install what ``bertopt`` asks for into an initialised engine."""
    for note in settle_engine(engine):
        print0(note)
    if undo_state_initialising_step(engine):
        print0(
            f"{type(engine.optimizer).__name__}: its state-creating zero-gradient step no longer counts "
            "(step counters back to 0, master weights as the model's)"
        )
    if bertopt.bucket_clip.enabled:
        install_bucket_clip(engine, bertopt.bucket_clip)
    client = getattr(engine, "client_optimizer", None)
    if isinstance(client, Lamb):
        attach_lamb(client, engine)
    print0(f"non-finite gradients skip the step ({install_nonfinite_guard(engine)})")
