"""Every transformers / accelerate internal ds_bertopt touches, named, with a start-up check.

``ds_bertopt.integrations.hf`` overrides or calls Trainer methods that are not public API (``_get_train_sampler``,
``_remove_unused_columns``, ``_save``, ``_load_from_checkpoint``, ``_train_batch_size``…) and relies on accelerate's
DeepSpeed plumbing; the model code sets ``config._attn_implementation``. :func:`check_api` looks each of them up at
import (by name, and the parameters we pass, by name) and raises one ``ImportError`` line naming the first that is
missing, with the installed and the known-good releases. :data:`KNOWN_GOOD` lists the releases the suite passed on.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Optional

KNOWN_GOOD = {"transformers": ("5.24.0", "5.25.0"), "accelerate": ("1.15.0", "1.16.0")}
"""Releases the suite (tests/test_hf_integration.py and the model tests) passed on."""
TESTED_VERSIONS = {package: versions[-1] for package, versions in KNOWN_GOOD.items()}
"""The newest of each (kept for callers of ``ds_bertopt.integrations.hf.TESTED_VERSIONS``)."""


def _api_table():
    """(object, attribute, parameter names it must accept, or None for a plain attribute). Parameters are checked by
    name, not position."""
    import accelerate
    from accelerate.data_loader import BatchSamplerShard
    from accelerate.utils import DeepSpeedPlugin
    from transformers import PretrainedConfig, Trainer, TrainerCallback
    from transformers.integrations import deepspeed as hf_deepspeed

    return [
        (
            Trainer,
            "__init__",
            (
                "model",
                "args",
                "data_collator",
                "train_dataset",
                "model_init",
                "callbacks",
                "optimizers",
                "optimizer_cls_and_kwargs",
            ),
        ),
        (Trainer, "create_optimizer", ("model",)),
        (Trainer, "create_scheduler", ("num_training_steps", "optimizer")),
        (Trainer, "get_train_dataloader", ()),
        (Trainer, "_get_train_sampler", ("train_dataset",)),
        (Trainer, "_set_signature_columns_if_needed", ()),
        (Trainer, "_remove_unused_columns", ("dataset", "description")),
        (Trainer, "_get_collator_with_removed_columns", ("data_collator", "description")),
        (Trainer, "_save", ("output_dir", "state_dict")),
        (Trainer, "_load_from_checkpoint", ("resume_from_checkpoint", "model")),
        (Trainer, "add_callback", ("callback",)),
        (TrainerCallback, "on_init_end", ("args", "state", "control")),
        (TrainerCallback, "on_train_begin", ("args", "state", "control")),
        (TrainerCallback, "on_step_end", ("args", "state", "control")),
        # deepspeed_init finalises the config, then deepspeed_optim_sched calls trainer.create_optimizer()
        (hf_deepspeed, "deepspeed_init", ("trainer", "num_training_steps")),
        (hf_deepspeed, "deepspeed_optim_sched", ("trainer", "hf_deepspeed_config", "args", "num_training_steps")),
        (accelerate.Accelerator, "_prepare_deepspeed", ()),
        (DeepSpeedPlugin, "__init__", ("hf_ds_config",)),
        (BatchSamplerShard, "__init__", ("batch_sampler", "num_processes", "process_index")),
        # the attention backend a config selects (from_pretrained's attn_implementation); None: an attribute
        (PretrainedConfig, "_attn_implementation", None),
    ]


def describe(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", repr(obj))


def check_api(table=None) -> None:
    """Raise a one-line ``ImportError`` naming the first function of ``table`` that is missing or lacks a parameter."""
    for owner, name, params in table if table is not None else _api_table():
        where = f"{describe(owner)}.{name}"
        func = getattr(owner, name, None)
        if params is None:
            if not hasattr(owner, name):
                raise ImportError(f"ds_bertopt.integrations.hf: {where} is missing ({versions_line()})")
            continue
        if not callable(func):
            raise ImportError(f"ds_bertopt.integrations.hf: {where} is missing ({versions_line()})")
        try:
            accepted = set(inspect.signature(func).parameters)
        except (TypeError, ValueError):
            accepted = set()
        missing = [p for p in params if p not in accepted]
        if missing:
            raise ImportError(
                f"ds_bertopt.integrations.hf: {where} takes no {', '.join(missing)} parameter ({versions_line()})"
            )


def installed_versions() -> dict[str, Optional[str]]:
    out = {}
    for package in (*KNOWN_GOOD, "deepspeed"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def versions_line() -> str:
    """Installed releases, then the known-good ones."""
    from .deepspeed import KNOWN_GOOD as DEEPSPEED_GOOD

    found = ", ".join(f"{p} {v or 'not installed'}" for p, v in installed_versions().items())
    good = "; ".join(f"{p} {', '.join(v)}" for p, v in {**KNOWN_GOOD, "deepspeed": DEEPSPEED_GOOD}.items())
    return f"{found}; known to work: {good}"


def untested_versions(deepspeed: bool) -> list[str]:
    """``"package version"`` for each installed release outside the known-good lists (DeepSpeed only if used)."""
    from .deepspeed import KNOWN_GOOD as DEEPSPEED_GOOD

    good = {**KNOWN_GOOD, "deepspeed": DEEPSPEED_GOOD}
    return [
        f"{p} {v} (known to work: {', '.join(good[p])})"
        for p, v in installed_versions().items()
        if v not in good[p] and (p != "deepspeed" or deepspeed)
    ]


TORCH_MODULES = {"use_kernels": False}
"""``from_pretrained`` keyword arguments that keep torch's own modules: from 5.25 ``use_kernels`` defaults to True
and ``kernelize`` may swap layers' forwards for hub kernels (the ``kernels`` package, a download), under the module
swaps of ds_bertopt.wtacrs and the unpadded model; 5.24 takes the key and defaults it to False."""


def attention_implementation(config) -> Optional[str]:
    """The attention backend a transformers config selects (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str) -> None:
    """Select ``name`` on a config that has no model yet (a model has ``set_attn_implementation``)."""
    config._attn_implementation = name
