"""Fine-tuning heads on the unpadded encoder: sequence classification and regression, token classification and
extractive question answering for every plain-attention family of :mod:`.families`, and their losses.

:class:`UnpaddedTaskModel` wraps a stock transformers ``*ForSequenceClassification`` / ``*ForTokenClassification`` /
``*ForQuestionAnswering`` model (or a PEFT model around one) and runs its base model on a packed row
(:class:`~.unpadded.UnpaddedEncoder`, the same forward as pretraining); its own head modules then read their
positions: each sequence's first token (``[CLS]``; ModernBERT's ``classifier_pooling: "mean"`` the mean of its
tokens), the labelled tokens only (token classification: the first sub-word of every word), or every token (start
and end logits). What differs per family is where the head's modules are and the order they run in, transcribed
from transformers 5.24's ``forward`` of each class (:func:`sequence_logits`, :func:`token_logits`,
:func:`span_logits`).

The losses are pure functions of logits and labels, shared by the padded and the unpadded path and by
``BertOptTrainer``: :func:`sequence_losses` (cross-entropy, or squared error for regression), :func:`token_losses`
and :func:`span_losses` (start and end cross-entropy over each sequence's own tokens, averaged: transformers' padded
models also softmax over their padding positions, whose logits a padding-free model does not have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from ..errors import ConfigError
from ..labels import IGNORE_INDEX
from .families import family_of_type
from .unpadded import UnpaddedEncoder

TASK_CLASS_SUFFIX = {
    "classification": "ForSequenceClassification",
    "regression": "ForSequenceClassification",
    "token_classification": "ForTokenClassification",
    "question_answering": "ForQuestionAnswering",
}
"""The transformers class of each task (``Bert`` + suffix, …); ``AutoModel`` + suffix loads any family."""


def auto_model_class(task: str):
    import transformers

    return getattr(transformers, "AutoModel" + TASK_CLASS_SUFFIX[task])


def task_of(model) -> str:
    """The task of a transformers task model (``regression``: one label), or a ``TypeError``."""
    name = type(model).__name__
    for task, suffix in TASK_CLASS_SUFFIX.items():
        if name.endswith(suffix):
            if task == "classification" and getattr(model.config, "num_labels", 2) == 1:
                return "regression"
            return task
    supported = ", ".join(dict.fromkeys(TASK_CLASS_SUFFIX.values()))
    raise TypeError(f"expected a transformers *{supported.replace(', ', ', *')} model, got {name}")


# ---------------------------------------------------------------- the heads, per family
def _first_tokens(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return hidden.index_select(0, cu_seqlens[:-1].long())


def sequence_logits(model, family: str, hidden: torch.Tensor, cu_seqlens, seq_lengths: Sequence[int]):
    """``[S, labels]`` from the packed ``hidden`` ``[T, hidden]`` of ``S`` sequences."""
    first = _first_tokens(hidden, cu_seqlens)
    if family == "bert":  # BertForSequenceClassification: pooler (first token) -> dropout -> classifier
        return model.classifier(model.dropout(model.base_model.pooler(first[:, None])))
    if family in ("roberta", "xlm-roberta", "camembert", "electra"):  # their ClassificationHead reads [:, 0, :]
        return model.classifier(first[:, None])
    if family == "distilbert":
        return model.classifier(model.dropout(F.relu(model.pre_classifier(first))))
    if family == "modernbert":
        if model.config.classifier_pooling == "mean":
            first = torch.stack([h.mean(0) for h in hidden.split(list(seq_lengths))])
        return model.classifier(model.drop(model.head(first)))
    raise ConfigError(f"sequence classification: no unpadded head for the {family} family")


def token_logits(model, family: str, hidden: torch.Tensor) -> torch.Tensor:
    """``[P, labels]`` from the hidden states of the labelled tokens (dropout and the classifier are token-wise)."""
    if family == "modernbert":
        return model.classifier(model.drop(model.head(hidden)))
    return model.classifier(model.dropout(hidden))


def span_logits(model, family: str, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start [T], end [T])`` logits."""
    if family == "modernbert":
        logits = model.classifier(model.drop(model.head(hidden)))
    elif family == "distilbert":
        logits = model.qa_outputs(model.dropout(hidden))
    else:
        logits = model.qa_outputs(hidden)
    start, end = logits.unbind(-1)
    return start, end


# ---------------------------------------------------------------- losses (pure)
def sequence_losses(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    """Per sequence: cross-entropy, or for regression the squared error of the one logit (fp32)."""
    if regression:
        return (logits.float().reshape(-1) - labels.float().reshape(-1)).square()
    return F.cross_entropy(logits.float(), labels, reduction="none")


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per labelled token: cross-entropy (``logits`` and ``labels`` at the labelled tokens only)."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def to_padded(values: torch.Tensor, pad_index: torch.Tensor, rows: int, width: int, fill: float) -> torch.Tensor:
    """``[T, ...]`` packed values laid out as ``[rows, width, ...]`` (``pad_index``: each token's flat position
    ``row × width + position``, made on the host by the collator), ``fill`` elsewhere."""
    out = values.new_full((rows * width, *values.shape[1:]), fill)
    return out.index_copy(0, pad_index, values).view(rows, width, *values.shape[1:])


def span_losses(start: torch.Tensor, end: torch.Tensor, start_positions, end_positions) -> torch.Tensor:
    """Per sequence: the mean of the start and end cross-entropies, ``start``/``end`` ``[S, L]`` with ``-inf`` at
    positions that are not the sequence's tokens (padding)."""
    return (
        F.cross_entropy(start.float(), start_positions, reduction="none")
        + F.cross_entropy(end.float(), end_positions, reduction="none")
    ) / 2


def task_losses(task: str, outputs, labels=None, start_positions=None, end_positions=None) -> torch.Tensor:
    """Per target losses of ``task`` from a model's ``outputs`` (``logits``, or ``start_logits``/``end_logits``):
    :func:`sequence_losses` per sequence, :func:`token_losses` per token (``0`` where ``labels`` is ``-100``, so
    padded ``[S, L, labels]`` logits with ``[S, L]`` labels sum to the labelled tokens' loss), :func:`span_losses`
    per window."""
    if task in ("classification", "regression"):
        return sequence_losses(outputs["logits"], labels, task == "regression")
    if task == "token_classification":
        logits = outputs["logits"]
        return token_losses(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return span_losses(outputs["start_logits"], outputs["end_logits"], start_positions, end_positions)


# ---------------------------------------------------------------- the model
@dataclass
class TaskOutput(ModelOutput):
    """A ``ModelOutput`` (ZeRO-3's hooks walk its tensors)."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    """Classification ``[S, labels]``; token classification ``[P, labels]`` at the labelled tokens."""
    start_logits: Optional[torch.Tensor] = None
    """Question answering: ``[T]`` packed, or ``[S, L]`` with ``pad_index`` (``-inf`` beyond each sequence)."""
    end_logits: Optional[torch.Tensor] = None


class UnpaddedTaskModel(UnpaddedEncoder):
    """A transformers task model (or a PEFT model around one) on packed, padding-free batches; see the module
    docstring. ``state_dict`` and ``save_pretrained`` are the wrapped model's."""

    def __init__(self, model, attention: str = "auto", compile: bool = False):
        get_base = getattr(model, "get_base_model", None)
        hf = get_base() if callable(get_base) else model
        self_task = task_of(hf)
        family = family_of_type(getattr(hf.config, "model_type", None), f"{type(hf).__name__}")
        super().__init__(model, family, attention, compile=compile)
        self.task = self_task

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[Sequence[int]] = None,
        label_positions: Optional[torch.Tensor] = None,
        pad_index: Optional[torch.Tensor] = None,
    ) -> TaskOutput:
        """The packed batch of :func:`ds_bertopt.data.collate.pack_sequences`; ``label_positions`` ``[P]`` (token
        classification: the labelled tokens, else every token); ``pad_index`` ``[T]`` (question answering: lays the
        start and end logits out as ``[S, max_seqlen]``, see :func:`to_padded`)."""
        hidden, lengths = self.encode(input_ids, cu_seqlens, token_type_ids, position_ids, max_seqlen, seq_lengths)
        family = self.family.name
        if self.task in ("classification", "regression"):
            return TaskOutput(logits=sequence_logits(self.hf, family, hidden, cu_seqlens, lengths))
        if self.task == "token_classification":
            picked = hidden if label_positions is None else hidden.index_select(0, label_positions)
            return TaskOutput(logits=token_logits(self.hf, family, picked))
        start, end = span_logits(self.hf, family, hidden)
        if pad_index is not None:
            rows, width = len(lengths), int(max_seqlen if max_seqlen is not None else max(lengths))
            start, end = (to_padded(x, pad_index, rows, width, float("-inf")) for x in (start, end))
        return TaskOutput(start_logits=start, end_logits=end)


# ---------------------------------------------------------------- with the loss: the stock models' forward
def _flat(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.reshape(-1)  # [1, T] rows


class UnpaddedTaskWithLoss(UnpaddedTaskModel):
    """:class:`UnpaddedTaskModel` with the stock model's forward: the packed batch of
    :class:`ds_bertopt.data.collate.PackedTaskFeatures` (token-wise tensors ``[1, T]``) and the task's targets in, the
    loss and the stock layouts out: ``logits [S, labels]``; token classification ``logits [S, L, labels]`` per sequence
    (``L``: the longest), with ``labels [S, L]`` padded with ``-100``; question answering ``start_logits``/
    ``end_logits [S, L]``, ``-inf`` beyond each sequence. The loss: per-target losses (:func:`task_losses`) summed
    and divided by ``num_items_in_batch`` when given (``Trainer``: the step's targets over every micro-batch and
    rank, so micro-batches of unequal size weigh each example equally), else averaged (per labelled token for token
    classification). One subclass per task, each naming its targets (``Trainer`` reads them from the forward's
    signature)."""

    accepts_loss_kwargs = True  # Trainer passes num_items_in_batch

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


class UnpaddedForSequenceClassification(UnpaddedTaskWithLoss):
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


class UnpaddedForTokenClassification(UnpaddedTaskWithLoss):
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


class UnpaddedForQuestionAnswering(UnpaddedTaskWithLoss):
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


TASK_MODEL_CLASSES = {
    "classification": UnpaddedForSequenceClassification,
    "regression": UnpaddedForSequenceClassification,
    "token_classification": UnpaddedForTokenClassification,
    "question_answering": UnpaddedForQuestionAnswering,
}


__all__ = [
    "TASK_CLASS_SUFFIX",
    "TASK_MODEL_CLASSES",
    "TaskOutput",
    "UnpaddedForQuestionAnswering",
    "UnpaddedForSequenceClassification",
    "UnpaddedForTokenClassification",
    "UnpaddedTaskModel",
    "UnpaddedTaskWithLoss",
    "auto_model_class",
    "sequence_logits",
    "sequence_losses",
    "span_logits",
    "span_losses",
    "task_losses",
    "task_of",
    "to_padded",
    "token_logits",
    "token_losses",
]
