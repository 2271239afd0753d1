"""Fine-tuning models as the memory kit measures and runs them, for every task, padded or packed.

* :func:`packed_task_model`: a prepared task model (LoRA, kit, WTA-CRS already applied) in its task's
  :class:`~ds_bertopt.model.heads.UnpaddedTaskWithLoss` (the stock model's forward and loss on packed rows), its
  sampled linears' batch context fed by the wrapper's forward keywords (``BertOptTrainer`` and the measurements).
* :func:`task_variant`: the ``spec["build"]`` of :func:`ds_bertopt.wtacrs.memory.measure_step` (``ds-bertopt memory
  --task ... --unpadded``, ``wtacrs.preset: "auto"``): the task's model, prepared per ``spec["wtacrs"]``, padded or,
  with ``spec["packed"]``, packed; and its synthetic batches: ``sequences`` full-length sequences of random tokens
  with random targets, padded (no padding: the worst case) or packed into one row (the same real tokens, the worst a
  token budget of ``sequences × seq`` holds: the longest sequences make attention largest); or sequences of the
  lengths ``spec["lengths"]`` (a real batch's), padded to the longest or packed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..compat.transformers import TORCH_MODULES
from ..configlib import load_section
from ..data.collate import PackedTaskFeatures
from ..errors import ConfigError
from ..labels import IGNORE_INDEX
from ..model.heads import TASK_MODEL_CLASSES, auto_model_class, task_of
from ..wtacrs import prepare_model, run_from
from ..wtacrs.config import WtaCrsConfig


def packed_task_model(model, attention: str = "auto", compile: bool = False):
    """``model`` (a transformers task model or a PEFT model around one, prepared) in its task's packed class;
    ``compile``: ``model.compile``."""
    get_base = getattr(model, "get_base_model", None)
    hf = get_base() if callable(get_base) else model
    task = task_of(hf)
    if getattr(hf.config, "problem_type", None) == "multi_label_classification":
        raise ConfigError(
            f"model.unpadded: {type(hf).__name__} is set up for multi-label classification (problem_type); the "
            "unpadded heads take one class per text, a number (regression), a tag per token or an answer span"
        )
    wrapper = TASK_MODEL_CLASSES[task](model, attention=attention, compile=compile)
    run_from(wrapper, model)
    return wrapper


def synthetic_features(task: str, lengths: Sequence[int], vocab: int, num_labels: int, seed: int) -> list[dict]:
    """Features of ``lengths`` random tokens each, with random targets for ``task`` (Trainer-style keys)."""
    gen = torch.Generator().manual_seed(seed)
    low = 1000 if vocab > 2000 else 1  # past BERT's [unused]/special ids when the vocabulary has them
    out = []
    for seq in lengths:
        feature = {"input_ids": torch.randint(low, vocab, (seq,), generator=gen).tolist(), "token_type_ids": [0] * seq}
        if task == "regression":
            feature["labels"] = float(torch.rand((), generator=gen))
        elif task == "classification":
            feature["labels"] = int(torch.randint(num_labels, (), generator=gen))
        elif task == "token_classification":
            feature["labels"] = [IGNORE_INDEX, *torch.randint(num_labels, (seq - 2,), generator=gen).tolist()]
            feature["labels"].append(IGNORE_INDEX)
        else:
            start, end = sorted(torch.randint(seq, (2,), generator=gen).tolist())
            feature.update(start_positions=start, end_positions=end)
        out.append(feature)
    return out


def padded_batch(task: str, features: list[dict]) -> dict:
    """Features padded to the longest (dynamic padding, as ``DataCollatorWithPadding`` pads) for the stock model."""
    width = max(len(f["input_ids"]) for f in features)
    pad = {"input_ids": 0, "token_type_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}
    for f in features:
        f["attention_mask"] = [1] * len(f["input_ids"])
    batch = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if isinstance(values[0], list):
            values = [v + [pad[key]] * (width - len(v)) for v in values]
        batch[key] = torch.as_tensor(values)
    if task == "regression":
        batch["labels"] = batch["labels"].float()
    return batch


def task_variant(spec: dict[str, Any]) -> tuple[torch.nn.Module, Callable[[int, int, int], dict]]:
    """``(model, make_batch)`` for ``spec`` (see the module docstring): ``task`` (default ``classification``),
    ``packed``, ``model`` (a checkpoint directory) or ``model_config`` (``{"model_type": ..., **kwargs}``: random
    init), ``num_labels``, ``wtacrs`` (a config dict), ``attention`` (packed: the unpadded attention, default
    ``auto``), ``lengths`` (the measured batch's sequence lengths, e.g. a real batch's: the padded model pads them to
    the longest, the packed one packs them); ``make_batch(sequences, seq, seed)``: ``sequences`` of ``seq`` tokens,
    or of ``lengths`` when there are that many."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a child's stderr is the user's terminal
    task = spec.get("task", "classification")
    num_labels = 1 if task == "regression" else 2 if task == "question_answering" else spec.get("num_labels", 2)
    torch.manual_seed(spec.get("seed", 0))
    model_class = auto_model_class(task)
    if spec.get("model_config") is not None:
        kwargs = dict(spec["model_config"])
        model = model_class.from_config(AutoConfig.for_model(kwargs.pop("model_type"), num_labels=num_labels, **kwargs))
    else:
        model = model_class.from_pretrained(
            spec["model"], num_labels=num_labels, ignore_mismatched_sizes=True, **TORCH_MODULES
        )
    model, _ = prepare_model(model, load_section(WtaCrsConfig, spec.get("wtacrs", {}), "wtacrs"))
    model.train()
    vocab = model.config.vocab_size
    packed = bool(spec.get("packed"))
    if packed:
        model = packed_task_model(model, spec.get("attention", "auto"))
    collate = PackedTaskFeatures(task) if packed else (lambda features: padded_batch(task, features))

    given = spec.get("lengths") or ()

    def make_batch(sequences: int, seq: int, seed: int) -> dict:
        lengths = list(given) if len(given) == sequences else [seq] * sequences
        return collate(synthetic_features(task, lengths, vocab, num_labels, seed))

    return model, make_batch


__all__ = ["packed_task_model", "padded_batch", "synthetic_features", "task_variant"]
