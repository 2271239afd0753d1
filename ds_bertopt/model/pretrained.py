"""A Hugging Face checkpoint loaded for masked-LM pretraining into its own architecture, strictly.

The architecture comes from the checkpoint's ``config.json`` (``model_type`` → :mod:`.families`), never from our
defaults: a RoBERTa directory loads into ``RobertaForMaskedLM``, a type we do not know stops the run in one line.
Whatever the load leaves over is judged by :func:`judge_load` (pure) instead of transformers' table of warnings:

* weights of the encoder missing, weights with no place in the model, or weights of another shape: a one-line
  error (the directory is not what its ``config.json`` says, or belongs to another architecture);
* the MLM head missing (an encoder-only checkpoint such as sentence-transformers' MiniLM): a new head, its output
  layer tied to the word embeddings, and one log line saying so;
* other heads of the family (pooler, next-sentence, classifiers): dropped, and one log line naming them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from ..compat.transformers import TORCH_MODULES
from ..errors import ConfigError
from .families import MlmFamily, family_of_type, model_class, under
from .local import check_model_dir

KEY = "model.init_checkpoint"
NSP_HEAD = ("cls.seq_relationship.", "pooler.")
"""What ``BertForPreTraining`` adds to the MLM model: a checkpoint without it gets a new one."""


def checkpoint_family(path: str, key: str = KEY) -> MlmFamily:
    """The family of the checkpoint directory ``path`` (checked: config.json, weights), or a one-line error."""
    config = check_model_dir(path, key)
    return family_of_type(config.get("model_type"), f"{key}: {path}")


def check_unpadded(family: MlmFamily, unpadded: bool) -> None:
    """``model.unpadded`` for a family that cannot run unpadded: one line naming it and the way to train it padded."""
    if unpadded and family.unpadded_blocker:
        raise ConfigError(
            f"model.unpadded: {family.name} cannot run unpadded ({family.unpadded_blocker}); set model.unpadded "
            "false to train it padded"
        )


def check_positions(family: MlmFamily, config, max_seq_length: int, path: str) -> None:
    if family.max_tokens(config) < max_seq_length:
        raise ConfigError(
            f"data.max_seq_length: {max_seq_length} exceeds the {family.max_tokens(config)} positions of the "
            f"checkpoint {path}"
        )


def _read_config(path: str, label: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{label}/config.json cannot be read: {str(exc).splitlines()[0][:200]}") from None


def _summary(keys, limit: int = 3) -> str:
    """Distinct names with layer numbers as ``*``, the first ``limit`` of them."""
    names = list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in k.split(".")) for k in sorted(keys)))
    more = f", … ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def judge_load(
    missing, unexpected, mismatched, family: MlmFamily, nsp: bool, base_prefix: str, label: str
) -> tuple[bool, list[str]]:
    """What a load left over, judged: ``(new_head, log lines)``; a one-line :class:`ConfigError` for anything that
    means the weights are not this model's. ``label`` names the checkpoint in messages."""
    heads = family.head_prefixes + (NSP_HEAD if nsp else ())
    dropped = tuple(p for p in family.dropped_prefixes if not (nsp and p in NSP_HEAD))
    if mismatched:
        first = mismatched[0] if isinstance(mismatched[0], str) else mismatched[0][0]
        raise ConfigError(f"{label}: {len(mismatched)} weights have other shapes than its config.json says ({first})")
    lost = [k for k in missing if not under(k, heads, base_prefix)]
    if lost:
        raise ConfigError(
            f"{label}: {len(lost)} weights of {family.mlm_class} are not in the checkpoint ({_summary(lost)}); "
            f"it is not a complete {family.name} checkpoint"
        )
    foreign = [k for k in unexpected if not under(k, dropped, base_prefix)]
    if foreign:
        raise ConfigError(
            f"{label}: {len(foreign)} of its weights have no place in {family.mlm_class} ({_summary(foreign)}); "
            f"is it a {family.name} checkpoint?"
        )

    def absent(prefixes):  # the head modules (prefixes) with a missing weight, as ``cls.predictions.*``
        return ", ".join(f"{p}*" for p in prefixes if any(under(k, (p,), base_prefix) for k in missing))

    lines = []
    new_head = absent(family.head_prefixes)
    if new_head:
        lines.append(
            f"model: the checkpoint has no MLM head ({new_head}): a new one is initialised, its output layer tied "
            "to the word embeddings"
        )
    new_nsp = absent(NSP_HEAD) if nsp else ""
    if new_nsp:
        lines.append(f"model: the checkpoint has no next-sentence head ({new_nsp}): a new one is initialised")
    if unexpected:
        lines.append(f"model: not used from the checkpoint (heads of other tasks): {_summary(unexpected)}")
    return bool(new_head), lines


def tie_output_embeddings(model) -> None:
    """The MLM output layer shares the word embeddings' weight (a new head starts from the checkpoint's vocabulary)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is inp.weight or out.weight.shape != inp.weight.shape:
        return  # DeBERTa's head reads the embeddings itself; a projection of another shape cannot be tied
    out.weight = inp.weight
    model.config.tie_word_embeddings = True


@contextlib.contextmanager
def quiet_transformers():
    """transformers' load report and progress bar off (we say what matters in one line each)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_pretrained(
    path: str,
    *,
    nsp: bool,
    vocab_size: int,
    max_seq_length: int,
    attn_implementation: str = "sdpa",
    key: str = KEY,
) -> tuple[torch.nn.Module, MlmFamily, list[str]]:
    """The checkpoint at ``path`` in its family's masked-LM class (fp32), checked against the tokenizer's
    ``vocab_size`` and ``max_seq_length``; returns the model, its family and the lines to log."""
    path = os.path.abspath(os.path.expanduser(path))
    family = checkpoint_family(path, key)
    cls = model_class(family, nsp)
    label = f"{key}: {path}"
    with quiet_transformers():
        config = _read_config(path, label)
        if config.vocab_size < vocab_size:
            raise ConfigError(
                f"{key}: the model's vocabulary has {config.vocab_size} entries but the tokenizer has {vocab_size}; "
                "use the tokenizer the model was trained with"
            )
        check_positions(family, config, max_seq_length, path)
        kwargs = {"attn_implementation": attn_implementation} if family.sdpa else {}
        try:
            model, info = cls.from_pretrained(
                path, config=config, dtype=torch.float32, output_loading_info=True, **kwargs, **TORCH_MODULES
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{label} cannot be loaded as {cls.__name__}: {str(exc).splitlines()[0][:200]}") from None
    new_head, lines = judge_load(
        info.get("missing_keys", ()),
        info.get("unexpected_keys", ()),
        info.get("mismatched_keys", ()),
        family,
        nsp,
        model.base_model_prefix,
        label,
    )
    if new_head:
        tie_output_embeddings(model)
    return model, family, [f"model: {cls.__name__} from {path}", *lines]


def resolve_checkpoint(model_cfg, data_cfg) -> tuple[object, object, Optional[MlmFamily], list[str]]:
    """The ``model`` and ``data`` sections of a run from a checkpoint, settled before anything is built:
    ``init_checkpoint`` (or, with ``continued``, the packaged MiniLM-L6) as an absolute, checked directory of a known
    family that can run as configured (``unpadded``, ``objective``), and ``data.tokenizer`` defaulting to the
    checkpoint's. Returns ``(model_cfg, data_cfg, family or None, log lines)``; random init returns them as given."""
    import dataclasses

    from .local import resolve_model_dir

    if not model_cfg.init_checkpoint and not model_cfg.continued:
        return model_cfg, data_cfg, None, []
    path, _ = resolve_model_dir(model_cfg.init_checkpoint, KEY)  # None: the packaged MiniLM-L6, said in the log
    family = checkpoint_family(path)
    check_unpadded(family, model_cfg.unpadded)
    with quiet_transformers():
        check_positions(family, _read_config(path, f"{KEY}: {path}"), data_cfg.max_seq_length, path)
    model_class(family, model_cfg.objective == "mlm_nsp")  # mlm_nsp needs a next-sentence head: one line if not
    lines = []
    if not data_cfg.tokenizer:
        if tokenizer_dir(path) is None:
            raise ConfigError(
                f"data.tokenizer: the checkpoint {path} holds no tokenizer; give data.tokenizer (the one the model "
                "was trained with)"
            )
        data_cfg = dataclasses.replace(data_cfg, tokenizer=path)
        lines.append(f"data.tokenizer: the checkpoint's ({path})")
    return dataclasses.replace(model_cfg, init_checkpoint=path), data_cfg, family, lines


def tokenizer_dir(path: Optional[str]) -> Optional[str]:
    """``path`` when it holds a tokenizer (what ``--model_name_or_path`` brings along), else ``None``."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model")
    if path and any(os.path.isfile(os.path.join(os.path.expanduser(path), n)) for n in names):
        return path
    return None


__all__ = [
    "check_unpadded",
    "checkpoint_family",
    "judge_load",
    "load_pretrained",
    "resolve_checkpoint",
    "tokenizer_dir",
]
