"""Unpadded fine-tuning heads inside a Hugging Face ``Trainer``: ``"bertopt": {"model": {"unpadded": true}}`` with a
``*ForSequenceClassification`` (classification, text pairs, regression), ``*ForTokenClassification`` or
``*ForQuestionAnswering`` model of a plain-attention family (:mod:`ds_bertopt.model.families`).

:class:`~ds_bertopt.integrations.hf.BertOptTrainer` (through :mod:`.hf_unpadded`) wraps such a model, after
:func:`ds_bertopt.wtacrs.prepare_model` (LoRA, memory kit, WTA-CRS, which work on top), in its task's
:class:`~ds_bertopt.model.heads.UnpaddedTaskWithLoss`: the launcher's unpadded heads with the stock model's forward,
loss and output layouts, so a stock script's ``compute_metrics`` and post-processing read them unchanged. Under
``Trainer`` the loss is divided by ``num_items_in_batch`` (``labels`` in the batch: the step's sequences or labelled
tokens over every micro-batch and rank), so micro-batches of unequal size, as the length-aware planner packs them,
weigh each example equally; without it (question answering, evaluation) it is the micro-batch's mean.

:class:`~ds_bertopt.data.collate.PackedTaskFeatures` takes the place of the script's collator
(``DataCollatorWithPadding``, ``DataCollatorForTokenClassification``, ``default_data_collator``): it packs each
micro-batch into one padding-free row, cutting features that arrive padded (``run_qa``'s ``pad_to_max_length``) to
their ``attention_mask``.
"""

from __future__ import annotations

from typing import Optional

from ..data.collate import PackedTaskFeatures
from ..errors import ConfigError
from ..model.heads import UnpaddedTaskWithLoss, task_of
from ..train.finetune_memory import packed_task_model, task_variant


def is_task_model(model) -> bool:
    """Whether ``model`` (or the transformers model in a PEFT model) is a task model :func:`wrap_task_model` takes."""
    get_base = getattr(model, "get_base_model", None)
    try:
        task_of(get_base() if callable(get_base) else model)
    except TypeError:
        return False
    return True


def measured_setup(model, unpadded: bool) -> Optional[dict]:
    """What ``wtacrs.preset: "auto"`` measures for ``model`` (``resolve_auto(task=...)``): its task, padded or packed;
    ``None`` (sequence classification, padded) for a model that is no task model."""
    if not is_task_model(model):
        return None
    get_base = getattr(model, "get_base_model", None)
    return {"build": task_variant, "task": task_of(get_base() if callable(get_base) else model), "packed": unpadded}


def wrap_task_model(model, attention: str, compile: bool = False) -> UnpaddedTaskWithLoss:
    """``model`` (prepared: LoRA, kit, WTA-CRS) in its task's class of :mod:`ds_bertopt.model.heads`."""
    return packed_task_model(model, attention, compile)


PACKABLE_COLLATORS = ("DataCollatorWithPadding", "DataCollatorForTokenClassification", "DefaultDataCollator")


def task_packing_collator(collator, task: str) -> PackedTaskFeatures:
    """The packing collator that takes the place of the script's padding collator (any other is refused: what it
    does to a batch would be lost)."""
    name = getattr(collator, "__name__", None) or type(collator).__name__
    if name not in PACKABLE_COLLATORS + ("default_data_collator",):
        raise ConfigError(
            f"model.unpadded: the Trainer's data_collator is a {name}; pass {', '.join(PACKABLE_COLLATORS)} or "
            "default_data_collator: packed batches take their place"
        )
    return PackedTaskFeatures(task)


__all__ = [
    "is_task_model",
    "measured_setup",
    "task_packing_collator",
    "wrap_task_model",
]
