"""Checking DeepSpeed's part of a config file the way DeepSpeed itself reads it.

DeepSpeed 0.19.8 ignores top-level keys it does not know (``"gradient_accumulation_step": 4`` trains
with accumulation 1, silently) and keys inside the blocks it reads key by key; blocks parsed by its
pydantic models (``zero_optimization``, ``bf16``, ``fp16``, the monitors, …) raise multi-line
``ValidationError``\\ s. :func:`check_deepspeed_config` runs DeepSpeed's own parser,
``deepspeed.runtime.config.DeepSpeedConfig``, on a copy of the dict whose mappings record every key
DeepSpeed looks up (and the default it passes to ``get``), so that what counts as known follows the
pinned version, not a list of ours. Then, with one line naming the key:

* a key DeepSpeed never looked up (at the top level, or in a block it read key by key) is unknown,
  with a close-match suggestion among the keys it did look up;
* a value whose type differs from the default DeepSpeed passed for it is a wrong type;
* a pydantic error becomes ``deepspeed.<block>.<field>: <message>`` (with a suggestion for an unknown field);
* any other error DeepSpeed's parser raises becomes ``deepspeed: <its first line>``.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import KeysView
from typing import Any, Optional

from .compat.deepspeed import config_model_base, config_parser
from .errors import ConfigError


class _Recording(dict):
    """A dict that records the keys looked up in it and the defaults given to ``get``."""

    def __init__(self, data: dict, path: str):
        super().__init__({k: _record(v, f"{path}.{k}") for k, v in data.items()})
        self.path, self.looked_up, self.defaults = path, set(), {}

    def get(self, key, default=None):
        self.looked_up.add(key)
        if default is not None:
            self.defaults.setdefault(key, default)
        return super().get(key, default)

    def __getitem__(self, key):
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked_up.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordingKeys(self)

    def __iter__(self):
        # Overriding it takes ``**block`` (how DeepSpeed hands blocks to its pydantic models) off CPython's
        # dict fast path onto keys() + __getitem__, so those keys count as looked up (pydantic checks them).
        return dict.__iter__(self)


class _RecordingKeys(KeysView):
    def __contains__(self, key):  # ``KEY in param_dict.keys()``, as DeepSpeed's getters write it
        self._mapping.looked_up.add(key)
        return dict.__contains__(self._mapping, key)


# Blocks DeepSpeed hands on whole to a constructor that checks them itself (the optimizer's and the
# scheduler's keyword arguments), so a key it reads from them in passing says nothing about the rest.
HANDED_ON_WHOLE = ("deepspeed.optimizer.params", "deepspeed.scheduler.params")


def _record(value: Any, path: str) -> Any:
    if not isinstance(value, dict) or path in HANDED_ON_WHOLE:
        return value
    return _Recording(value, path)


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(str(key), sorted(map(str, known)), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_problem(value: Any, default: Any) -> Optional[str]:
    """What is wrong with ``value`` for a key whose DeepSpeed default is ``default``, or None."""
    if default is None or value is None or isinstance(default, (dict, list, tuple)):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "expected a string"
    return None


def _walk(node: _Recording) -> None:
    """Raise for the first unknown key or mistyped scalar in ``node`` and the blocks below it."""
    if node.looked_up:  # a block DeepSpeed read key by key (not one handed on whole, e.g. optimizer params)
        for key in node:
            if key not in node.looked_up:
                raise ConfigError(
                    f"{node.path}: unknown key {key!r}{_suggest(key, node.looked_up)}; DeepSpeed "
                    f"{_deepspeed_version()} would ignore it"
                )
        for key, default in node.defaults.items():
            if key in node:
                problem = _type_problem(dict.__getitem__(node, key), default)
                if problem:
                    raise ConfigError(f"{node.path}.{key}: {problem}, got {json.dumps(dict.__getitem__(node, key))}")
    for value in dict.values(node):
        if isinstance(value, _Recording):
            _walk(value)


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _pydantic_line(exc, raw: dict) -> str:
    """One line for DeepSpeed's pydantic ``ValidationError``: the block, the field, the message."""
    error = exc.errors()[0]
    loc = [str(part) for part in error.get("loc", ())]
    model = _model_named(exc.title)
    block = _block_holding(raw, model, loc)
    where = ".".join(["deepspeed"] + ([block] if block else []) + loc)
    if error.get("type") == "extra_forbidden":
        inner = _nested_model(model, loc[:-1])
        known = set()
        if inner is not None:
            known = set(inner.model_fields) | {f.alias for f in inner.model_fields.values() if f.alias}
        parent = where.rsplit(".", 1)[0]
        return f"{parent}: unknown key {loc[-1]!r}{_suggest(loc[-1], known)}"
    message = str(error.get("msg", exc)).removeprefix("Value error, ")
    got = error.get("input")
    shown = f", got {json.dumps(got)}" if isinstance(got, (str, int, float, bool)) or got is None else ""
    return f"{where}: {message}{shown}"


def _nested_model(model, path: list[str]):
    """The pydantic model of the sub-block at ``path`` inside ``model`` (None when it is not one)."""
    from pydantic import BaseModel

    for part in path:
        field = getattr(model, "model_fields", {}).get(part) if model is not None else None
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _model_named(title: str):
    stack = [config_model_base()]
    while stack:
        cls = stack.pop()
        if cls.__name__ == title:
            return cls
        stack.extend(cls.__subclasses__())
    return None


def _block_holding(raw: dict, model, loc: list[str]) -> Optional[str]:
    """The top-level block whose dict the model was built from (found by its first located key)."""
    if loc and loc[0] in raw:  # the model took the whole top-level dict (e.g. the monitors)
        return None
    fields = set(model.model_fields) if model is not None else set()
    for key, value in raw.items():
        if isinstance(value, dict) and ((loc and loc[0] in value) or (fields and set(value) <= fields | set(loc))):
            return key
    return None


def check_deepspeed_config(ds: dict) -> None:
    """Raise :class:`ConfigError` (one line) for anything DeepSpeed would ignore or reject in ``ds``.

    ``ds`` is DeepSpeed's part of the config after batch resolution; the batch triple is re-stated for the
    world DeepSpeed's parser sees (ours is checked against the real world size by ``resolve_batch``).
    """
    import pydantic
    import torch.distributed as dist

    DeepSpeedConfig = config_parser()

    raw = copy.deepcopy(ds)
    micro, accum = raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps")
    if isinstance(micro, int) and isinstance(accum, int):  # for the world DeepSpeedConfig will see (1 before init)
        raw["train_batch_size"] = micro * accum * (dist.get_world_size() if dist.is_initialized() else 1)
    recording = _Recording(raw, "deepspeed")
    try:
        DeepSpeedConfig(recording)
    except pydantic.ValidationError as exc:
        raise ConfigError(_pydantic_line(exc, raw)) from None
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises assorted types for bad values
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _walk(recording)  # an unknown or mistyped key is the likelier cause: name it first
        raise ConfigError(f"deepspeed: {first}") from None
    _walk(recording)


def zero_stage(ds: dict) -> int:
    """The ZeRO stage DeepSpeed's part asks for (0 when absent, or not a number: DeepSpeed's own parser names it)."""
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    return int(stage) if isinstance(stage, (int, float)) or str(stage).isdigit() else 0


def optimizer_offload(ds: dict) -> Optional[str]:
    """``"cpu"`` / ``"nvme"`` when ZeRO-Offload moves the optimizer off the accelerator (its state and step run on
    the host), else None (DeepSpeed's ``zero_use_cpu_optimizer`` reads the same key)."""
    block = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    device = block.get("device", "none") if isinstance(block, dict) else "none"
    return device if device in ("cpu", "nvme") else None
