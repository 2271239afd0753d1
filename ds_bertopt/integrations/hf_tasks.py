"""Unpadded fine-tuning heads inside a Hugging Face ``Trainer``: ``"bertopt": {"model": {"unpadded": true}}`` with a
``*ForSequenceClassification`` (classification, text pairs, regression), ``*ForTokenClassification`` or
``*ForQuestionAnswering`` model of a plain-attention family (:mod:`ds_bertopt.model.families`).

:class:`~ds_bertopt.integrations.hf.BertOptTrainer` (through :mod:`.hf_unpadded`) wraps such a model, after
:func:`ds_bertopt.wtacrs.prepare_model` (LoRA, memory kit, WTA-CRS, which work on top), in the task's class here: the
launcher's :class:`~ds_bertopt.model.heads.UnpaddedTaskModel` with the forward ``Trainer`` calls and the outputs a
stock script's ``compute_metrics`` and post-processing read unchanged:

* sequence classification: ``logits [S, labels]``, ``labels [S]`` (as padded);
* token classification: ``logits [S, L, labels]`` laid out per sequence (``L``: the micro-batch's longest), with the
  ``labels [S, L]`` the collator pads with ``-100``, as ``DataCollatorForTokenClassification`` does;
* question answering: ``start_logits``/``end_logits [S, L]``, ``-inf`` beyond each sequence.

The loss is the stock model's (cross-entropy per sequence or labelled token, squared error for regression, the mean
of the start and end cross-entropies per window), summed and divided by ``num_items_in_batch`` when ``Trainer``
passes it (``labels`` in the batch: the step's sequences or labelled tokens over every micro-batch and rank, so
micro-batches of unequal size, as the length-aware planner packs them, weigh each example equally), else averaged
over the micro-batch (question answering, evaluation).

:class:`PackedTaskFeatures` takes the place of the script's collator (``DataCollatorWithPadding``,
``DataCollatorForTokenClassification``, ``default_data_collator``): it packs each micro-batch into one padding-free
row, cutting features that arrive padded (``run_qa``'s ``pad_to_max_length``) to their ``attention_mask``. The batch
starts with its per-sequence tensor (``labels``, ``start_positions``): ``Trainer`` counts examples by the first
tensor's first dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ..data.collate import pack_sequences, padded_positions
from ..errors import ConfigError
from ..labels import IGNORE_INDEX
from ..model.heads import TaskOutput, UnpaddedTaskModel, task_losses, task_of, to_padded


def _flat(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.reshape(-1)  # [1, T] rows (see PackedTaskFeatures)


class TrainerUnpaddedTask(UnpaddedTaskModel):
    """:class:`UnpaddedTaskModel` as ``Trainer`` calls it; one subclass per task, each naming its label arguments
    (``Trainer`` finds them in the forward's signature: ``labels``, or ``start_positions``/``end_positions``)."""

    accepts_loss_kwargs = True  # Trainer passes num_items_in_batch (the step's targets, see the module docstring)

    def _task_forward(self, packed: dict, pad_index, targets: dict, num_items_in_batch) -> TaskOutput:
        out = UnpaddedTaskModel.forward(
            self,
            _flat(packed["input_ids"]),
            packed["cu_seqlens"],
            _flat(packed["token_type_ids"]),
            _flat(packed["position_ids"]),
            packed["max_seqlen"],
            packed["seq_lengths"],
            pad_index=pad_index if self.task == "question_answering" else None,
        )
        if self.task == "token_classification":
            rows, width = packed["cu_seqlens"].numel() - 1, int(packed["max_seqlen"])
            out.logits = to_padded(out.logits, pad_index, rows, width, 0.0)
        if all(value is not None for value in targets.values()):
            losses = task_losses(self.task, out, **targets)
            if num_items_in_batch is not None:
                out.loss = losses.sum() / num_items_in_batch
            elif self.task == "token_classification":
                out.loss = losses.sum() / (targets["labels"] != IGNORE_INDEX).sum().clamp_min(1)
            else:
                out.loss = losses.mean()
        return out


def _packed(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths) -> dict:
    return dict(
        input_ids=input_ids,
        cu_seqlens=cu_seqlens,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        max_seqlen=max_seqlen,
        seq_lengths=seq_lengths,
    )


class UnpaddedForSequenceClassification(TrainerUnpaddedTask):
    """Classification (a text or a pair) and regression (``num_labels`` 1)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[tuple] = None,
        attention_mask: Optional[torch.Tensor] = None,  # noqa: ARG002 - the collator's input; kept as a column
        num_items_in_batch=None,
    ) -> TaskOutput:
        packed = _packed(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths)
        return self._task_forward(packed, None, {"labels": labels}, num_items_in_batch)


class UnpaddedForTokenClassification(TrainerUnpaddedTask):
    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        pad_index: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[tuple] = None,
        attention_mask: Optional[torch.Tensor] = None,  # noqa: ARG002
        num_items_in_batch=None,
    ) -> TaskOutput:
        packed = _packed(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths)
        return self._task_forward(packed, pad_index, {"labels": labels}, num_items_in_batch)


class UnpaddedForQuestionAnswering(TrainerUnpaddedTask):
    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        pad_index: torch.Tensor,
        start_positions: Optional[torch.Tensor] = None,
        end_positions: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[tuple] = None,
        attention_mask: Optional[torch.Tensor] = None,  # noqa: ARG002
        num_items_in_batch=None,
    ) -> TaskOutput:
        packed = _packed(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths)
        targets = {"start_positions": start_positions, "end_positions": end_positions}
        return self._task_forward(packed, pad_index, targets, num_items_in_batch)


TRAINER_CLASSES = {
    "classification": UnpaddedForSequenceClassification,
    "regression": UnpaddedForSequenceClassification,
    "token_classification": UnpaddedForTokenClassification,
    "question_answering": UnpaddedForQuestionAnswering,
}


def is_task_model(model) -> bool:
    """Whether ``model`` (or the transformers model in a PEFT model) is a task model :func:`wrap_task_model` takes."""
    get_base = getattr(model, "get_base_model", None)
    try:
        task_of(get_base() if callable(get_base) else model)
    except TypeError:
        return False
    return True


def wrap_task_model(model, attention: str) -> TrainerUnpaddedTask:
    """``model`` (prepared: LoRA, kit, WTA-CRS) in its task's Trainer class; its sampled linears' batch context is
    fed by the wrapper's forward keywords."""
    from ..wtacrs.linear import feed_context

    get_base = getattr(model, "get_base_model", None)
    hf = get_base() if callable(get_base) else model
    task = task_of(hf)
    if getattr(hf.config, "problem_type", None) == "multi_label_classification":
        raise ConfigError(
            f"model.unpadded: {type(hf).__name__} is set up for multi-label classification (problem_type); the "
            "unpadded heads take one class per text, a number (regression), a tag per token or an answer span"
        )
    wrapper = TRAINER_CLASSES[task](model, attention=attention)
    feed_context(wrapper, model)
    return wrapper


# ---------------------------------------------------------------- the packing collator
TARGET_KEYS = {
    "classification": ("labels",),
    "regression": ("labels",),
    "token_classification": ("labels",),
    "question_answering": ("start_positions", "end_positions"),
}


def _real_tokens(feature: Mapping, index: int) -> int:
    """The feature's token count: all of ``input_ids``, or the leading ones its ``attention_mask`` keeps."""
    mask = feature.get("attention_mask")
    length = len(feature["input_ids"])
    if mask is None:
        return length
    mask = [int(m) for m in mask]
    n = sum(mask)
    if mask != [1] * n + [0] * (length - n):
        raise ConfigError(
            f"model.unpadded: feature {index} of the batch is not right-padded (its attention_mask is not ones then "
            "zeros); tokenize with padding_side='right'"
        )
    return n


def _label(feature: Mapping):
    for key in ("labels", "label", "label_ids"):
        if key in feature and feature[key] is not None:
            return feature[key]
    return None


class PackedTaskFeatures:
    """A ``Trainer`` collator for ``task``: features (mappings with ``input_ids``, optionally ``token_type_ids``,
    ``attention_mask`` and the task's targets) → one packed row (see the module docstring). Targets are given for
    every feature of a batch or for none (prediction)."""

    def __init__(self, task: str):
        self.task = task

    def __call__(self, features: list) -> dict:
        samples, targets = [], {key: [] for key in TARGET_KEYS[self.task]}
        for index, feature in enumerate(features):
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                raise ConfigError("model.unpadded: training examples must be mappings with input_ids")
            n = _real_tokens(feature, index)
            types = feature.get("token_type_ids")
            samples.append(
                {"input_ids": list(feature["input_ids"])[:n], "token_type_ids": list(types)[:n] if types else [0] * n}
            )
            for key in targets:
                value = _label(feature) if key == "labels" else feature.get(key)
                targets[key].append(list(value)[:n] if self.task == "token_classification" and value else value)
        packed = pack_sequences(samples)
        width = packed["max_seqlen"]
        batch = {}
        for key, values in targets.items():
            given = [v is not None for v in values]
            if any(given) and not all(given):
                raise ConfigError(f"model.unpadded: some examples of a batch have {key} and some not")
            if all(given):
                batch[key] = self._target(values, width)
        for key in ("input_ids", "token_type_ids", "position_ids"):
            batch[key] = packed[key][None]
        batch.update(cu_seqlens=packed["cu_seqlens"], max_seqlen=width, seq_lengths=packed["seq_lengths"])
        if self.task in ("token_classification", "question_answering"):
            batch["pad_index"] = padded_positions(packed["seq_lengths"], width)
        return batch

    def _target(self, values: list, width: int) -> torch.Tensor:
        if self.task == "token_classification":  # [S, L], -100 beyond each sequence
            out = torch.full((len(values), width), IGNORE_INDEX, dtype=torch.long)
            for row, labels in enumerate(values):
                out[row, : len(labels)] = torch.as_tensor(labels, dtype=torch.long)
            return out
        dtype = torch.float32 if self.task == "regression" else torch.long
        return torch.as_tensor(values, dtype=dtype).reshape(len(values))


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
    "PackedTaskFeatures",
    "TRAINER_CLASSES",
    "TrainerUnpaddedTask",
    "UnpaddedForQuestionAnswering",
    "UnpaddedForSequenceClassification",
    "UnpaddedForTokenClassification",
    "is_task_model",
    "task_packing_collator",
    "wrap_task_model",
]
