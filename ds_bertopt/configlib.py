"""Strict loading of frozen dataclasses from JSON-like dicts.

Each config section is a frozen dataclass whose fields carry a docstring (the string literal
right after the field). ``load_section(cls, data, path)`` builds it and rejects, with one line
naming the dotted key:

* unknown keys (with a close-match suggestion, so ``"max_step"`` says ``did you mean max_steps``),
* values of the wrong type (``true`` where a number is expected, ``"3"`` where an int is),
* values a section's ``__post_init__`` refuses (it runs however the dataclass is built, so a
  section constructed in Python is checked exactly like one loaded from JSON).

Nested dataclass fields are loaded recursively; ``Optional``, ``Literal``, ``tuple[...]``,
``list[...]`` and ``dict[str, ...]`` are understood. Nothing here knows about DeepSpeed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Any, Literal, Optional, Union, get_args, get_origin

from .errors import ConfigError


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; convert lists to tuples and dicts to dataclasses."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{path}: expected {_type_name(tp)}, got {json.dumps(value)}"
        )
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {json.dumps(value)} is not one of {', '.join(json.dumps(a) for a in allowed)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {json.dumps(value)}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            items = [_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {json.dumps(value)}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return load_section(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {json.dumps(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{path}: expected an integer, got {json.dumps(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {json.dumps(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {json.dumps(value)}")
        return value
    raise TypeError(f"configlib: unsupported annotation {tp!r} at {path}")


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict:
    """``typing.get_type_hints`` of a config class, evaluated once (it parses every string annotation)."""
    return typing.get_type_hints(cls)


def load_section(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from ``data`` (a dict), strictly. ``path`` names it in errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected an object, got {json.dumps(data)}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known keys: {', '.join(sorted(fields))}")
    kwargs = {name: _coerce(value, hints[name], f"{path}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{path}.{exc}") from None


def to_dict(obj: Any) -> Any:
    """Inverse of :func:`load_section` (tuples become lists), for logging and checkpoints."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """``set_dotted(d, "train.max_steps", 5)`` sets ``d["train"]["max_steps"] = 5``."""
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {key} is not an object")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value``; the value is JSON when it parses, else a plain string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


# ------------------------------------------------------------------------------------------------
# The command line, generated from the dataclasses: every field is a flag, its docstring the help.
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a config dataclass, read from the string literal after each field (parsed once per
    class: every command line is generated from them)."""

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, Any, str]]:
    """``(dotted key, annotation, default, docstring)`` of every leaf field below ``cls``."""
    hints, docs = _type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, f"{key}.")
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        yield key, tp, default, docs.get(f.name, "")


def _cli_kind(tp: Any) -> tuple[Any, Optional[str], Optional[tuple]]:
    """``(argparse type, nargs, choices)`` for an annotation; values are re-parsed by :func:`load_section`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _cli_kind(inner[0]) if len(inner) == 1 else (str, None, None)
    if origin is Literal:
        return type(args[0]), None, args
    if origin in (tuple, list):
        item = args[0] if args else str
        return (item if item in (int, float, str) else str), "+", None
    if tp is bool:
        return _parse_bool, None, None
    return (tp if tp in (int, float, str) else str), None, None


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


_parse_bool.__name__ = "true/false"  # argparse names the type in its error message


def add_config_arguments(parser, cls: type, root: str, shortcuts: Optional[dict[str, str]] = None) -> None:
    """Add ``--<section>.<field>`` for every field below ``cls`` (and ``--<shortcut>`` for the keys named in
    ``shortcuts``), with the field's docstring as help. Parsed values are kept as given; turn them into
    overrides with :func:`overrides_from_namespace`, so one loader validates file, flags and ``-o`` alike."""

    by_key = {key: (tp, default, doc) for key, tp, default, doc in iter_fields(cls)}
    aliases: dict[str, list[str]] = {}
    for flag, key in (shortcuts or {}).items():
        if key not in by_key:
            raise KeyError(f"shortcut --{flag}: {root}.{key} is not a config field")
        aliases.setdefault(key, []).append(flag)
    groups: dict[str, Any] = {}
    for key, (tp, default, doc) in by_key.items():
        section = key.split(".")[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{root}.{section}")
        kind, nargs, choices = _cli_kind(tp)
        help_text = (doc.replace("%", "%%") + f" (built-in default: {json.dumps(to_dict(default))})").strip()
        names = [f"--{flag}" for flag in aliases.get(key, [])] + [f"--{key}"]
        extra = (
            {"nargs": "?", "const": True, "metavar": "true|false"}
            if kind is _parse_bool
            else {"nargs": nargs, "choices": choices, "metavar": key.rsplit(".", 1)[-1].upper()}
        )
        groups[section].add_argument(
            *names, dest=f"cfg:{key}", type=kind, default=argparse.SUPPRESS, help=help_text, **extra
        )


def overrides_from_namespace(namespace) -> list[str]:
    """The ``key=json`` overrides of the config flags given on the command line (see :func:`add_config_arguments`)."""
    out = []
    for dest, value in vars(namespace).items():
        if dest.startswith("cfg:"):
            out.append(f"{dest[4:]}={json.dumps(list(value) if isinstance(value, tuple) else value)}")
    return out


# ------------------------------------------------------------------------------------------------
# Dead keys: a section says which of its fields cannot matter under the rest of it.
# ------------------------------------------------------------------------------------------------
def dead_fields_of(obj: Any, prefix: str = "") -> dict[str, str]:
    """``{dotted key: why}`` of every field below dataclass ``obj`` whose value cannot matter: the union of each
    (nested) section's ``dead_fields()`` (``{field name or dotted key relative to the section: why}``), defined
    beside the fields it judges. The caller refuses those the user set."""
    out = {}
    judge = getattr(obj, "dead_fields", None)
    if callable(judge):
        out.update({f"{prefix}{key}": why for key, why in judge().items()})
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(dead_fields_of(value, f"{prefix}{f.name}."))
    return out
