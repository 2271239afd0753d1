"""ds_bertopt's fine-tuning memory savings under Hugging Face ``Trainer`` (and ``accelerate launch``).

Two lines in an existing ``Trainer`` script::

    from ds_bertopt.integrations.hf import BertOptTrainer
    trainer = BertOptTrainer(model=model, args=training_args, ...)   # was: Trainer(...)

The ``"bertopt"`` section is read from the DeepSpeed JSON given as ``TrainingArguments(deepspeed=...)`` (or
``accelerate launch --deepspeed_config_file``), or from ``bertopt=`` (a dict, a file, a ``BertOptConfig``).
Where each part hooks into Trainer's lifecycle (transformers 5.24-5.25, accelerate 1.15-1.16, DeepSpeed 0.16-0.19):

1. ``__init__``, *before* ``Trainer.__init__``: :func:`ds_bertopt.wtacrs.prepare_model` (LoRA → memory kit →
   WTA-CRS swaps) on ``model`` (or on every ``model_init()`` result). DeepSpeed's engine is only built later in
   ``train()`` (``Trainer._prepare_for_training`` → ``Accelerator.prepare`` → ``Accelerator._prepare_deepspeed``
   → ``deepspeed.initialize``), so ZeRO 0–3 partition the swapped model.
2. Right after ``Trainer.__init__``: ``"bertopt"`` is removed from accelerate's ``DeepSpeedPlugin.deepspeed_config``
   (the dict ``_prepare_deepspeed`` hands to ``deepspeed.initialize(config_params=...)``); DeepSpeed 0.19.8 ignores
   unknown top-level keys (``DeepSpeedConfig`` only rejects its own removed keys), but it is not DeepSpeed's. With
   ``bucket_clip`` on, DeepSpeed's ``gradient_clipping`` is set to 0 there (the hook replaces it).
3. ``get_train_dataloader``: with the gradient-norm cache, the training dataset is wrapped so every example carries
   its index under ``wtacrs_example_ids``, and the collator is wrapped to lift it out of the features and add it
   to the batch — the user's collator is untouched. ``Trainer.compute_loss`` calls ``model(**inputs)``; the
   forward pre-hook that :func:`~ds_bertopt.wtacrs.convert` put on the root model pops the keyword before the HF
   model sees it. With ``sampler.strategy`` other than ``random``, the loader's batch sampler is our
   :class:`~ds_bertopt.data.sampler.PlanBatchSampler` (already per rank, like transformers' own
   ``BatchRebalanceSampler``, whose handling in ``Trainer._get_dataloader`` this mirrors).
4. ``create_optimizer`` / ``create_scheduler`` (called by ``transformers.integrations.deepspeed.deepspeed_optim_sched``
   under DeepSpeed, by ``Trainer._prepare_for_training`` otherwise): when the section has ``"optimizer"`` or
   ``"schedule"``, :func:`ds_bertopt.optim.build` (LAMB / AdamW, MLPerf schedules) replaces Trainer's.
5. :class:`BertOptCallback` ``on_train_begin`` (after the engine exists, before the first step):
   :func:`ds_bertopt.engine.attach_extensions` (bucket-clip hook, LAMB's ZeRO attachment) and checks that the engine
   runs the converted model and our optimizer; ``on_step_end`` of the first step checks that example ids reached
   the gradient-norm cache.

Anything that cannot be applied is a one-line :class:`~ds_bertopt.errors.ConfigError` before training starts, or a
one-line log message when something is ignored on purpose (sections only our own loops read). The transformers /
accelerate functions this depends on are checked at import (:func:`~ds_bertopt.compat.transformers.check_api`);
a missing one is a one-line ``ImportError`` naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from .. import optim
from ..compat.transformers import TESTED_VERSIONS, check_api, describe, untested_versions, versions_line
from ..config import BertOptConfig, leaf_keys, refuse_emulated_bf16
from ..configlib import dead_fields_of, load_section
from ..data.collate import padded_positions
from ..data.sampler import PlanBatchSampler
from ..dist import release_shm_buffer, shutdown_at_exit, topology_from_env
from ..dsconfig import zero_stage
from ..engine import attach_extensions, check_combinations
from ..errors import ConfigError
from ..log import print0
from ..wtacrs import prepare_model
from ..wtacrs.fallback import FALLBACK_PRESETS
from ..wtacrs.sizing import resolve_preset
from ..wtacrs.linear import EXAMPLE_IDS_KWARG, NUM_VALID_ROWS_KWARG, PACKED_INDEX_KWARG, SampledLinear
from .hf_tasks import measured_setup
from .hf_unpadded import UnpaddedTrainerMixin

SECTION = "bertopt"
LOOP_ONLY_SECTIONS = ("model", "data", "train", "finetune")
"""Sections that configure ds_bertopt's own loops; under Trainer, ``TrainingArguments`` and the script set them."""
_STASH = "_ds_bertopt_section"  # where the stripped section is kept on accelerate's DeepSpeedPlugin


check_api()


# ---------------------------------------------------------------- output
def _say(message: str) -> None:
    print0(message)


# ---------------------------------------------------------------- DeepSpeed under Trainer on CPU-only hosts
def configure_cpu_deepspeed() -> bool:
    """Work around accelerate 1.15 counting one process under DeepSpeed on a CPU-only host. Call it before
    ``TrainingArguments`` when DeepSpeed will be used, and pass ``accelerator_config={"use_configured_state": True}``
    (:func:`cpu_deepspeed_argv` does both for ``HfArgumentParser`` scripts).

    ``PartialState._prepare_backend`` (accelerate/state.py) picks a backend only for accelerators, so on a CPU-only
    host under a launcher the backend stays ``None`` and ``PartialState`` reports ``num_processes = 1`` although
    ``deepspeed.init_distributed`` formed the whole group; Trainer then sizes DeepSpeed's ``train_batch_size`` for
    one rank. Creating the state first with DeepSpeed's CPU backend (gloo, or ccl with oneCCL) gives it the real
    world size. Returns whether it did anything (nothing on GPU hosts or outside a multi-rank launcher).
    """
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator

    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments._setup_devices does around PartialState
    try:
        PartialState(backend=get_accelerator().communication_backend_name())
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    return True


def cpu_deepspeed_argv(argv: list[str]) -> list[str]:
    """``argv`` for ``HfArgumentParser``, plus ``--accelerator_config '{"use_configured_state": true}'`` after
    :func:`configure_cpu_deepspeed` when DeepSpeed (``--deepspeed`` in ``argv``, or ``accelerate launch
    --use_deepspeed``) runs several ranks on a CPU-only host; ``argv`` unchanged otherwise."""
    argv = list(argv)
    deepspeed = (
        any(a == "--deepspeed" or a.startswith("--deepspeed=") for a in argv)
        or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    )
    if deepspeed and configure_cpu_deepspeed() and not any(a.startswith("--accelerator_config") for a in argv):
        argv += ["--accelerator_config", json.dumps({"use_configured_state": True})]
    return argv


def check_world_size(args) -> None:
    """One line instead of DeepSpeed's batch assertion when accelerate miscounted the processes (see above)."""
    if (
        getattr(args, "deepspeed_plugin", None) is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() != args.world_size
    ):
        raise ConfigError(
            f"accelerate counts {args.world_size} process(es) but torch.distributed has "
            f"{torch.distributed.get_world_size()} (DeepSpeed on a CPU-only host): call "
            "ds_bertopt.integrations.hf.configure_cpu_deepspeed() before TrainingArguments and pass "
            'accelerator_config={"use_configured_state": true} (cpu_deepspeed_argv(argv) does both)'
        )


def _release_shm_buffer() -> None:
    """Unlink this rank's DeepSpeed CPU allreduce buffer once every rank has mapped its peers' (the barrier): else
    each Trainer job on CPU leaves ~66 MB per rank in /dev/shm for good (see :func:`ds_bertopt.dist.release_shm_buffer`,
    which the launcher's path calls after its own collective)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and not torch.cuda.is_available():
        torch.distributed.barrier()  # every rank is past deepspeed.init_distributed, so has mapped every buffer
        release_shm_buffer(torch.distributed.get_rank())


# ---------------------------------------------------------------- config
@dataclass(frozen=True)
class HfBertOptConfig:
    """The ``"bertopt"`` section as the integration applies it."""

    bertopt: BertOptConfig
    """The parsed section (strictly: an unknown key is an error naming it)."""
    given: frozenset
    """Top-level keys the user wrote (for a typed config: the sections that differ from the defaults)."""
    source: str
    """Where it came from, for messages."""

    def __post_init__(self) -> None:
        unknown = set(self.given) - {f.name for f in dataclasses.fields(BertOptConfig)}
        if unknown:
            raise ConfigError(f"{SECTION}: unknown section {sorted(unknown)[0]!r}")

    @property
    def uses_our_optimizer(self) -> bool:
        """``"optimizer"`` or ``"schedule"`` given: :func:`ds_bertopt.optim.build` replaces Trainer's optimizer."""
        return "optimizer" in self.given or "schedule" in self.given

    @property
    def uses_plan_sampler(self) -> bool:
        return self.bertopt.sampler.strategy != "random"

    @property
    def feeds_example_ids(self) -> bool:
        wtacrs = self.bertopt.wtacrs
        return wtacrs.enabled and wtacrs.grad_norm_cache

    @property
    def converts_model(self) -> bool:
        wtacrs = self.bertopt.wtacrs
        return wtacrs.enabled or wtacrs.kit.any or wtacrs.lora.enabled

    @property
    def ignored_sections(self) -> list[str]:
        unpadded = self.bertopt.model.unpadded  # model.unpadded is read under Trainer too (hf_mlm)
        return [name for name in LOOP_ONLY_SECTIONS if name in self.given and not (name == "model" and unpadded)]


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{SECTION}: config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{SECTION}: {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{SECTION}: {path} cannot be read: {exc}") from None


def _from_section(section: Any, source: str) -> HfBertOptConfig:
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"{SECTION}: expected an object in {source}, got {type(section).__name__}")
    bertopt = load_section(BertOptConfig, section, SECTION)
    # dead keys of the sections Trainer's path reads (the others are named by ignored_sections)
    dead = {k: why for k, why in dead_fields_of(bertopt).items() if k.split(".")[0] not in LOOP_ONLY_SECTIONS}
    hit = sorted(k for k in leaf_keys(section, "") if k in dead)
    if hit:
        raise ConfigError(f"{SECTION}.{hit[0]}: has no effect: {dead[hit[0]]} (in {source}); remove it")
    return HfBertOptConfig(bertopt, frozenset(section), source)


def _section_from_plugin(plugin) -> Any:
    stashed = getattr(plugin, _STASH, None)
    if stashed is not None:
        return stashed  # an earlier trainer on the same TrainingArguments stripped it already
    return (getattr(plugin, "deepspeed_config", None) or {}).get(SECTION)


def _plugin_source(args) -> str:
    if isinstance(getattr(args, "deepspeed", None), str):
        return args.deepspeed
    if getattr(args, "deepspeed", None) is not None:
        return "TrainingArguments(deepspeed=<dict>)"
    return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the DeepSpeed plugin's config"


def load_bertopt(source: Any = None, *, args: Any = None) -> HfBertOptConfig:
    """The ``"bertopt"`` section from ``source`` or, when it is ``None``, from ``args``' DeepSpeed config.

    ``source``: a JSON file or dict that is either a DeepSpeed config with a ``"bertopt"`` key or the section
    itself; a :class:`~ds_bertopt.config.BertOptConfig`; a ``RunConfig``; an :class:`HfBertOptConfig`.
    ``args``: ``TrainingArguments`` whose ``deepspeed_plugin`` (set from ``deepspeed=`` or by ``accelerate launch
    --use_deepspeed --deepspeed_config_file``) holds the DeepSpeed JSON.
    """
    if isinstance(source, HfBertOptConfig):
        return source
    if source is None:
        plugin = getattr(args, "deepspeed_plugin", None)
        section = _section_from_plugin(plugin) if plugin is not None else None
        if section is None:
            where = (
                f"the DeepSpeed config {_plugin_source(args)}"
                if plugin is not None
                else "TrainingArguments (no deepspeed= config)"
            )
            raise ConfigError(
                f'{SECTION}: no "{SECTION}" section in {where} and no bertopt= given; add one to '
                "the DeepSpeed JSON or pass BertOptTrainer(..., bertopt=dict or path)"
            )
        return _from_section(section, _plugin_source(args))
    typed = source.bertopt if isinstance(getattr(source, "bertopt", None), BertOptConfig) else source
    if isinstance(typed, BertOptConfig):
        defaults = BertOptConfig()
        given = {
            f.name for f in dataclasses.fields(BertOptConfig) if getattr(typed, f.name) != getattr(defaults, f.name)
        }
        return HfBertOptConfig(typed, frozenset(given), "a BertOptConfig")
    if isinstance(source, (str, os.PathLike)):
        label, data = os.fspath(source), _read_json(os.fspath(source))
    elif isinstance(source, dict):
        label, data = "bertopt=<dict>", source
    else:
        raise ConfigError(f"{SECTION}: bertopt= must be a path, a dict or a BertOptConfig, got {type(source).__name__}")
    if isinstance(data, dict) and SECTION in data:
        data = data[SECTION]
    return _from_section(data, label)


def check_compatibility(cfg: HfBertOptConfig, ds_config: Optional[dict], args: Any) -> None:
    """Refuse, in one line, what this Trainer setup cannot apply. ``ds_config``: ``None`` without DeepSpeed."""
    b = cfg.bertopt
    if cfg.uses_our_optimizer:
        for block in ("optimizer", "scheduler"):
            if ds_config is not None and block in ds_config:
                raise ConfigError(
                    f'the DeepSpeed "{block}" block and {SECTION}.optimizer/schedule both set the '
                    f"optimizer; drop one (from {cfg.source})"
                )
    if ds_config is not None:
        check_combinations(b, ds_config, our_optimizer=cfg.uses_our_optimizer)
    if getattr(args, "bf16", False) is True and not getattr(args, "use_cpu", False):
        refuse_emulated_bf16("TrainingArguments.bf16")  # transformers accepts emulated bf16 (is_bf16_supported())
    if b.bucket_clip.enabled:
        if ds_config is None:
            raise ConfigError(
                "bucket_clip: needs DeepSpeed (TrainingArguments(deepspeed=...) or accelerate launch "
                "--use_deepspeed); without it use TrainingArguments.max_grad_norm"
            )
        if getattr(args, "auto_find_batch_size", False):
            raise ConfigError(
                "bucket_clip: not supported with TrainingArguments.auto_find_batch_size (Trainer "
                "re-derives DeepSpeed's gradient_clipping, which bucket_clip sets to 0)"
            )
    if cfg.uses_plan_sampler and getattr(args, "train_sampling_strategy", "random") != "random":
        raise ConfigError(
            f"sampler.strategy: {b.sampler.strategy!r} and TrainingArguments.train_sampling_strategy "
            f"{args.train_sampling_strategy!r} both choose the batches; keep one"
        )


def strip_bertopt_section(plugin) -> Optional[dict]:
    """Remove ``"bertopt"`` from the DeepSpeed config accelerate will pass to ``deepspeed.initialize``; keep it on
    ``plugin`` so a second trainer on the same ``TrainingArguments`` still finds it. Returns the section."""
    hf_ds_config = getattr(plugin, "hf_ds_config", None)
    candidates = (getattr(plugin, "deepspeed_config", None), getattr(hf_ds_config, "config", None))
    configs = {id(c): c for c in candidates if isinstance(c, dict)}  # normally one dict, referenced twice
    section = getattr(plugin, _STASH, None)
    for config in configs.values():
        popped = config.pop(SECTION, None)
        section = section if section is not None else popped
    if section is not None:
        setattr(plugin, _STASH, section)
    return section


# ---------------------------------------------------------------- example ids for the gradient-norm cache
class ExampleIdDataset(torch.utils.data.Dataset):
    """``dataset`` whose items (mappings) also carry their index under ``wtacrs_example_ids``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return _with_example_id(self.dataset[index], index)

    def __getitems__(self, indices: list) -> list:
        # torch's fetcher uses __getitems__ when present (datasets.Dataset has a batched one)
        fetch = getattr(self.dataset, "__getitems__", None)
        items = fetch(indices) if callable(fetch) else [self.dataset[i] for i in indices]
        return [_with_example_id(item, index) for item, index in zip(items, indices)]


def _with_example_id(item, index: int) -> dict:
    if not isinstance(item, Mapping):
        raise ConfigError(
            f"wtacrs.grad_norm_cache: training examples must be mappings (dicts) to carry example ids; "
            f"got {type(item).__name__}"
        )
    out = dict(item)
    out[EXAMPLE_IDS_KWARG] = int(index)
    return out


class ExampleIdCollator:
    """Wraps a collator: lifts ``wtacrs_example_ids`` out of the features, collates the rest with the user's
    collator, and adds the ids to the batch as an int64 tensor. Features without ids (evaluation) pass through.
    With ``count_valid_rows`` it also adds the batch's real-token count as a Python int
    (``wtacrs_num_valid_rows``: the sampled linears' budget k without a device read; Trainer moves only tensors)."""

    def __init__(self, collator, count_valid_rows: bool = False):
        self.collator = collator
        self.count_valid_rows = count_valid_rows

    def __call__(self, features: list):
        if not features or not isinstance(features[0], Mapping) or EXAMPLE_IDS_KWARG not in features[0]:
            return self._with_count(self.collator(features))
        ids = [feature[EXAMPLE_IDS_KWARG] for feature in features]
        batch = self.collator([{k: v for k, v in feature.items() if k != EXAMPLE_IDS_KWARG} for feature in features])
        if not isinstance(batch, Mapping):
            raise ConfigError(
                f"wtacrs.grad_norm_cache: the data collator returned a {type(batch).__name__}, "
                "not a mapping, so example ids cannot join the batch"
            )
        packed = "cu_seqlens" in batch  # model.unpadded: one padding-free row
        if "attention_mask" not in batch and not packed:
            raise ConfigError(
                "wtacrs.grad_norm_cache: the training batches have no attention_mask; the cache keys "
                "token rows by it (use a collator that pads, e.g. DataCollatorWithPadding)"
            )
        batch[EXAMPLE_IDS_KWARG] = torch.tensor(ids, dtype=torch.long)
        if packed:  # where each token sits in its example: the cache's key
            batch[PACKED_INDEX_KWARG] = padded_positions(batch["seq_lengths"], batch["max_seqlen"])
        return self._with_count(batch)

    def _with_count(self, batch):
        if self.count_valid_rows and isinstance(batch, Mapping) and torch.is_tensor(batch.get("attention_mask")):
            batch[NUM_VALID_ROWS_KWARG] = int(batch["attention_mask"].sum())
        return batch


# ---------------------------------------------------------------- the callback (what runs once the engine exists)
class BertOptCallback(TrainerCallback):
    """The lifecycle half of the integration, installed by :class:`BertOptTrainerMixin` (not usable alone: a
    callback runs after ``Trainer.__init__`` took the model, too late for LoRA, and cannot reach the dataloader
    or the DeepSpeed engine)."""

    def __init__(self, trainer: Optional[Trainer] = None):
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._attached = weakref.WeakSet()  # engines the extensions are installed on
        self._first_step: Optional[int] = None

    def _owner(self):
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            raise ConfigError(
                "BertOptCallback is installed by BertOptTrainer (or BertOptTrainerMixin); use "
                "`from ds_bertopt.integrations.hf import BertOptTrainer` instead of adding the callback"
            )
        return trainer

    def on_init_end(self, args, state, control, **kwargs):
        self._owner()

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._owner()
        cfg: HfBertOptConfig = trainer._bertopt
        engine = trainer.model_wrapped
        if cfg.bertopt.wtacrs.enabled:
            module = getattr(engine, "module", engine)
            if not any(isinstance(m, SampledLinear) for m in module.modules()):
                raise RuntimeError(
                    "ds_bertopt.integrations.hf: the model Trainer trains has no SampledLinear (the "
                    "converted model was replaced after BertOptTrainer.__init__)"
                )
        self._first_step = state.global_step + 1 if cfg.feeds_example_ids else None
        if not trainer.is_deepspeed_enabled:
            return
        from deepspeed import DeepSpeedEngine

        if not isinstance(engine, DeepSpeedEngine):
            raise RuntimeError(
                f"ds_bertopt.integrations.hf: Trainer.model_wrapped is a {type(engine).__name__} after "
                "Accelerator.prepare, not the DeepSpeed engine"
            )
        if SECTION in (engine.config if isinstance(engine.config, dict) else {}):
            raise RuntimeError(f'ds_bertopt.integrations.hf: the "{SECTION}" section reached deepspeed.initialize')
        ours = getattr(trainer, "_bertopt_optimizer", None)
        if cfg.uses_our_optimizer and getattr(engine, "client_optimizer", None) is not ours:
            raise RuntimeError(
                "ds_bertopt.integrations.hf: DeepSpeed did not receive the bertopt optimizer "
                "(transformers' deepspeed_optim_sched no longer calls Trainer.create_optimizer?)"
            )
        if engine not in self._attached:
            attach_extensions(engine, cfg.bertopt)
            self._attached.add(engine)

    def on_step_end(self, args, state, control, **kwargs):
        if self._first_step is None or state.global_step != self._first_step:
            return
        self._first_step = None

        trainer = self._owner()
        caches = [m.cache for m in trainer.model.modules() if isinstance(m, SampledLinear) and m.cache is not None]
        # one host sync, once per train(): the check that ids reached the cache
        if caches and not any(c.tags is not None and bool((c.tags >= 0).any()) for c in caches):
            raise RuntimeError(
                "ds_bertopt.integrations.hf: wtacrs.grad_norm_cache: no example ids reached the model "
                f'in the first step (the "{EXAMPLE_IDS_KWARG}" batch key was dropped on the way)'
            )


# ---------------------------------------------------------------- the Trainer
class BertOptTrainerMixin:
    """Mix into any ``transformers.Trainer`` subclass (``class MyTrainer(BertOptTrainerMixin, SFTTrainer)``).

    Takes the Trainer's arguments plus ``bertopt=`` (see :func:`load_bertopt`; default: the ``"bertopt"`` section
    of ``args``' DeepSpeed config)."""

    def __init__(self, *positional, bertopt: Any = None, **keywords):
        signature = inspect.signature(super().__init__)
        for name in ("model", "args", "model_init"):
            if name not in signature.parameters:
                raise TypeError(f"BertOptTrainerMixin: {describe(super().__init__)} has no {name!r} parameter")
        bound = signature.bind_partial(*positional, **keywords)
        arguments = bound.arguments
        check_world_size(arguments.get("args"))
        _release_shm_buffer()
        shutdown_at_exit()  # the script's end is the user's: destroy the process group before finalisation
        self._bertopt = load_bertopt(bertopt, args=arguments.get("args"))
        self._bertopt_optimizer = None
        self._bertopt_scheduler = None
        self._bertopt_scheduler_steps = None
        cfg = self._bertopt
        if cfg.uses_our_optimizer and (
            any(x is not None for x in (arguments.get("optimizers") or (None, None)))
            or arguments.get("optimizer_cls_and_kwargs") is not None
        ):
            raise ConfigError(
                f"{SECTION}.optimizer/schedule and Trainer's optimizers= / optimizer_cls_and_kwargs= "
                "both set the optimizer; drop one"
            )
        self._bertopt_args = arguments.get("args")
        self._bertopt_batch = None  # the micro-batch preset "auto" found, with auto_find_batch_size
        if arguments.get("model") is not None:
            arguments["model"] = self._bertopt_prepare(arguments["model"])
        if arguments.get("model_init") is not None:
            arguments["model_init"] = self._bertopt_model_init(arguments["model_init"])
        super().__init__(*bound.args, **bound.kwargs)  # calls model_init, if given (preset "auto" resolves there)
        cfg = self._bertopt  # preset "auto" resolved
        if self._bertopt_batch is not None and self._bertopt_batch != self.args.per_device_train_batch_size:
            # Trainer's find_executable_batch_size starts here (and still halves it on an out-of-memory error);
            # its inner loop passes the size on to DeepSpeed (Trainer._update_auto_batch_size)
            self._train_batch_size = self._bertopt_batch * max(1, self.args.n_gpu)
            _say(
                f"wtacrs: preset auto: auto_find_batch_size starts at micro-batch {self._bertopt_batch} "
                f"(per_device_train_batch_size {self.args.per_device_train_batch_size} does not fit or is slower)"
            )

        for name in ("accelerator", "is_deepspeed_enabled", "model_wrapped", "_train_batch_size", "data_collator"):
            if not hasattr(self, name):
                raise ImportError(
                    f"ds_bertopt.integrations.hf: Trainer has no {name} after __init__ ({versions_line()})"
                )
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        ds_config = plugin.deepspeed_config if plugin is not None else None
        check_compatibility(cfg, ds_config, self.args)
        if plugin is not None:
            strip_bertopt_section(plugin)
            if cfg.bertopt.bucket_clip.enabled and ds_config.get("gradient_clipping", 0):
                _say(
                    f"bucket_clip is on: DeepSpeed's gradient_clipping ({ds_config['gradient_clipping']}) set to 0; "
                    f"each rank clips each bucket to max_norm {cfg.bertopt.bucket_clip.max_norm} before allreduce"
                )
                ds_config["gradient_clipping"] = 0.0
        sampled = any(isinstance(m, SampledLinear) for m in (self.model.modules() if self.model is not None else ()))
        if cfg.feeds_example_ids or sampled:
            self.data_collator = ExampleIdCollator(self.data_collator, count_valid_rows=sampled)
        self.add_callback(BertOptCallback(self))
        self._bertopt_announce(deepspeed=plugin is not None)

    def _bertopt_announce(self, deepspeed: bool) -> None:
        cfg = self._bertopt
        differ = untested_versions(deepspeed)
        if differ:
            _say(f"warning: ds_bertopt.integrations.hf runs {', '.join(differ)}")
        if cfg.ignored_sections:
            _say(
                f"{SECTION}: {', '.join(cfg.ignored_sections)} configure ds_bertopt's own loops and are not used "
                "under Trainer (TrainingArguments and the script set them)"
            )
        if not (
            cfg.converts_model
            or cfg.uses_our_optimizer
            or cfg.uses_plan_sampler
            or cfg.bertopt.bucket_clip.enabled
            or cfg.bertopt.model.unpadded
        ):
            _say(f"{SECTION}: the section ({cfg.source}) enables nothing; training as a plain Trainer")

    # -- 1. the model
    def _bertopt_resolve_preset(self, model) -> None:
        """``wtacrs.preset`` ``exact``/``balanced``/``auto`` at the Trainer's micro-batch, one rule for both loops
        (:func:`~ds_bertopt.wtacrs.sizing.resolve_preset`): the fallback to full where recomputation does not pay;
        ``auto`` measures the candidates on the model's checkpoint (with ``auto_find_batch_size``: the largest batch
        that fits, up to it) and keeps the fastest that fits."""
        wtacrs, args = self._bertopt.bertopt.wtacrs, self._bertopt_args
        auto = wtacrs.preset == "auto"
        source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", "")
        if auto and not (source and os.path.isdir(source)):
            raise ConfigError(
                f'wtacrs.preset: "auto" measures the model from its checkpoint directory; {type(model).__name__} '
                f"was not loaded from one (name_or_path {source!r}): load it with from_pretrained(DIR) or set a preset"
            )
        if args is None:
            if auto:
                raise ConfigError(
                    'wtacrs.preset: "auto" needs TrainingArguments (its micro-batch, precision and device)'
                )
            return  # no micro-batch to judge the fallback by: the preset as asked
        positions = getattr(model.config, "max_position_embeddings", None)
        seq = wtacrs.budget_seq_length or positions
        if not isinstance(seq, int):
            raise ConfigError("wtacrs.budget_seq_length: give it (the model has no max_position_embeddings)")
        ds = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
        resolved, batch, lines = resolve_preset(
            wtacrs,
            model,
            batch=args.per_device_train_batch_size,
            seq=seq,
            precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            zero_stage=zero_stage(ds),
            world=max(1, args.world_size),
            model_dir=source,
            device=args.device.type,
            num_labels=getattr(model.config, "num_labels", 2),
            threads=torch.get_num_threads(),
            search_batch=bool(args.auto_find_batch_size),
            task=measured_setup(model, self._bertopt.bertopt.model.unpadded),
        )
        for line in lines:
            _say(line)
        if wtacrs.budget_seq_length is None:
            _say(
                f"wtacrs: preset {wtacrs.preset} {'measured' if auto else 'estimated'} at seq {seq} "
                "(max_position_embeddings); set wtacrs.budget_seq_length to the longest batch you train on to size "
                "tighter"
            )
        cfg = self._bertopt
        bertopt = dataclasses.replace(cfg.bertopt, wtacrs=resolved)
        self._bertopt = HfBertOptConfig(bertopt, cfg.given, cfg.source)
        self._bertopt_batch = batch if auto and args.auto_find_batch_size else None

    def _bertopt_prepare(self, model):
        if self._bertopt.bertopt.wtacrs.preset in FALLBACK_PRESETS:
            self._bertopt_resolve_preset(model)
        wtacrs = self._bertopt.bertopt.wtacrs
        if getattr(model, "_ds_bertopt_prepared", False):
            _say("model: already prepared by ds_bertopt; not converted again")
            return model
        if wtacrs.lora.enabled and hasattr(model, "peft_config"):
            raise ConfigError(
                "wtacrs.lora.enabled: the model is already a PEFT model; pass the base model or set lora.enabled false"
            )
        model, lines = prepare_model(model, wtacrs)
        for line in lines:
            _say(line)
        if wtacrs.enabled and not any(isinstance(m, SampledLinear) for m in model.modules()):
            raise ConfigError(
                f"wtacrs.targets: {list(wtacrs.targets)} matched no trainable nn.Linear of "
                f"{type(model).__name__}; name module patterns that exist or set wtacrs.enabled false"
            )
        object.__setattr__(model, "_ds_bertopt_prepared", True)
        return model

    def _bertopt_model_init(self, model_init):
        # Trainer.call_model_init passes the trial only to a one-argument model_init
        if len(inspect.signature(model_init).parameters) == 1:
            return lambda trial: self._bertopt_prepare(model_init(trial))
        return lambda: self._bertopt_prepare(model_init())

    # -- 3. the training data
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._bertopt.feeds_example_ids and EXAMPLE_IDS_KWARG not in self._signature_columns:
            self._signature_columns.append(EXAMPLE_IDS_KWARG)  # else RemoveColumnsCollator drops the ids

    def _get_train_sampler(self, train_dataset=None):
        if isinstance(train_dataset, ExampleIdDataset):
            train_dataset = train_dataset.dataset  # same indices; lets group_by_length read a length column
        return super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        cfg = self._bertopt
        dataset = self.train_dataset
        if (cfg.feeds_example_ids or cfg.uses_plan_sampler) and isinstance(dataset, torch.utils.data.IterableDataset):
            what = "wtacrs.grad_norm_cache" if cfg.feeds_example_ids else "sampler.strategy"
            raise ConfigError(f"{what}: needs a map-style training dataset (indices); got an IterableDataset")
        if cfg.uses_plan_sampler:
            return self._bertopt_planned_dataloader(dataset)
        if not cfg.feeds_example_ids:
            return super().get_train_dataloader()
        self.train_dataset = ExampleIdDataset(dataset)
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset = dataset

    def _bertopt_lengths(self, dataset) -> list[int]:
        column = self.args.length_column_name
        if hasattr(dataset, "column_names") and column in dataset.column_names:
            return [int(n) for n in dataset[column]]
        if hasattr(dataset, "column_names") and "attention_mask" in dataset.column_names:
            return [int(sum(m)) for m in dataset["attention_mask"]]  # examples padded up front (pad_to_max_length)
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        try:
            return [len(dataset[i][names[0]]) for i in range(len(dataset))]
        except (KeyError, TypeError):
            raise ConfigError(
                f"sampler.strategy: training examples need {names[0]!r} (or a {column!r} column) for "
                "the length-aware plan"
            ) from None

    def _bertopt_planned_dataloader(self, dataset):

        args = self.args
        lengths = self._bertopt_lengths(dataset)
        if hasattr(dataset, "column_names"):  # a datasets.Dataset: Trainer removes unused columns up front
            dataset = self._remove_unused_columns(dataset, description="Training")
            collator = self.data_collator
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        world = max(1, args.world_size)
        # the launcher's own variables first (dist.topology_from_env's order): accelerate's in-process PartialState
        # writes LOCAL_WORLD_SIZE into os.environ, where a later deepspeed launch inherits it stale
        local = topology_from_env().ranks_per_node if world > 1 else 1
        sampler = PlanBatchSampler(
            lengths,
            rank=args.process_index if world > 1 else 0,
            world_size=world,
            ranks_per_node=local,
            micro_batch=self._train_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            cfg=self._bertopt.bertopt.sampler,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        if self._bertopt.feeds_example_ids:
            dataset = ExampleIdDataset(dataset)
        workers = args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )
        loader = self.accelerator.prepare(loader)
        # The plan is per rank already: make accelerate's BatchSamplerShard a pass-through, as Trainer._get_dataloader
        # does for its own rank-aware BatchRebalanceSampler.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        if len(loader) != len(sampler):
            raise RuntimeError(
                f"ds_bertopt.integrations.hf: accelerate's loader yields {len(loader)} batches, the "
                f"plan {len(sampler)}; its batch-sampler sharding changed"
            )
        budget = getattr(sampler.planner, "budget", None)  # the packed strategies' (samples, tokens) per micro-batch
        per_step = (
            f"; a rank's step holds at most {budget[1] * args.gradient_accumulation_steps} tokens (sampler."
            f"micro_batch_tokens {budget[1]} × {args.gradient_accumulation_steps} micro-batches)"
            if budget
            else ""
        )
        _say(
            f"sampler: {self._bertopt.bertopt.sampler.strategy} plan, {sampler.steps_per_epoch} steps per epoch "
            f"({len(lengths)} examples, {world} ranks, {local} per node){per_step}"
        )
        return loader

    # -- 4. optimizer and schedule
    def _bertopt_zero_stage(self) -> int:
        if not self.is_deepspeed_enabled:
            return 0
        return zero_stage(self.accelerator.state.deepspeed_plugin.deepspeed_config or {})

    def create_optimizer(self, model=None):
        if not self._bertopt.uses_our_optimizer:
            return super().create_optimizer(model)
        if self.optimizer is None:
            max_steps = int(self.state.max_steps or 0)
            if max_steps <= 0:
                raise ConfigError(
                    "schedule: Trainer has not set max_steps when creating the optimizer "
                    "(create_optimizer called outside train()?)"
                )
            b = self._bertopt.bertopt
            b = dataclasses.replace(b, train=dataclasses.replace(b.train, max_steps=max_steps))
            global_batch = self._train_batch_size * self.args.gradient_accumulation_steps * max(1, self.args.world_size)
            self.optimizer, self._bertopt_scheduler = optim.build(
                model if model is not None else self.model,
                b,
                global_batch=global_batch,
                zero_stage=self._bertopt_zero_stage(),
            )
            self._bertopt_optimizer, self._bertopt_scheduler_steps = self.optimizer, max_steps
            _say(
                f"optimizer: {SECTION}.optimizer ({b.optimizer.type}) and schedule ({b.schedule.type}, {max_steps} "
                "steps) replace TrainingArguments' optim, learning_rate, weight_decay, lr_scheduler_type and warmup"
            )
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if not self._bertopt.uses_our_optimizer:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            if self._bertopt_scheduler is None:
                raise ConfigError(
                    f"{SECTION}.schedule: no schedule was built with the optimizer (a second train() on "
                    "this trainer without DeepSpeed); create a new BertOptTrainer"
                )
            if num_training_steps != self._bertopt_scheduler_steps:
                raise RuntimeError(
                    f"ds_bertopt.integrations.hf: the schedule was built for "
                    f"{self._bertopt_scheduler_steps} steps, Trainer asks for {num_training_steps}"
                )
            self.lr_scheduler, self._bertopt_scheduler = self._bertopt_scheduler, None
            self._created_lr_scheduler = True  # Trainer._prepare_for_training resets it on the next train()
        return self.lr_scheduler


class BertOptTrainer(UnpaddedTrainerMixin, BertOptTrainerMixin, Trainer):
    """``transformers.Trainer`` plus the ``"bertopt"`` section (see the module docstring; ``model.unpadded``:
    :mod:`ds_bertopt.integrations.hf_unpadded`)."""


__all__ = [
    "BertOptCallback",
    "BertOptTrainer",
    "BertOptTrainerMixin",
    "ExampleIdCollator",
    "ExampleIdDataset",
    "HfBertOptConfig",
    "TESTED_VERSIONS",
    "check_api",
    "check_compatibility",
    "check_world_size",
    "configure_cpu_deepspeed",
    "cpu_deepspeed_argv",
    "load_bertopt",
    "strip_bertopt_section",
]
