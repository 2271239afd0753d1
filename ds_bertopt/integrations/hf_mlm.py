"""Unpadded masked-LM pretraining inside a Hugging Face ``Trainer``: ``"bertopt": {"model": {"unpadded": true}}``.

:class:`~ds_bertopt.integrations.hf.BertOptTrainer` mixes :class:`~.hf_unpadded.UnpaddedTrainerMixin` in; with the key
set and a masked-LM model (task models: :mod:`.hf_tasks`):

1. ``model`` (a masked-LM model of a family in :mod:`ds_bertopt.model.families`) is wrapped in
   :class:`TrainerUnpaddedMLM` before ``Trainer.__init__``, so DeepSpeed's engine (ZeRO 0–3) is built around it.
   It is :class:`~ds_bertopt.model.unpadded.UnpaddedMLM` with the forward ``Trainer`` calls: the packed batch,
   ``labels``, and ``num_items_in_batch`` (``accepts_loss_kwargs``: the sum of token losses divided by the step's
   masked-token count, as the stock MLM models do under ``Trainer``).
2. The training and evaluation loaders pack each micro-batch into one padding-free row, one sequence per document
   (a ``group_texts`` block is cut before each ``[CLS]``/``<s>``), and mask it
   (:class:`PackedMLMFeatures`: the tokenizer and ``mlm_probability`` of the script's
   ``DataCollatorForLanguageModeling``, torch's RNG as that collator uses it); the batches are still the user's
   sampler's, or the length-aware planner's with ``sampler.strategy`` (``packed_node_balance`` packs micro-batches
   of equal cost across ranks).
3. Once the engine has placed the model, :meth:`UnpaddedMLM.choose_attention` decides the attention kernel, and
   rank 0 logs it.
4. ``save_model`` and checkpoints write the wrapped Hugging Face model (``from_pretrained``-loadable), and
   ``resume_from_checkpoint`` loads it back.

Evaluation returns ``(mlm_logits [1, M, vocab], mlm_labels [1, M])`` (the masked positions only) as the
predictions; a
``preprocess_logits_for_metrics`` / ``compute_metrics`` pair reads accuracy from them (``examples/run_mlm.py``'s
work for both layouts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ..data.collate import PackedMLMCollator, document_lengths
from ..errors import ConfigError
from ..model.bert import PretrainOutput
from ..model.unpadded import UnpaddedMLM


class TrainerUnpaddedMLM(UnpaddedMLM):
    """:class:`UnpaddedMLM` as ``Trainer`` calls it (MLM only; ``labels`` is its one label argument)."""

    accepts_loss_kwargs = True  # Trainer passes num_items_in_batch (and scales the loss as for stock MLM models)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        seq_lengths: Optional[tuple] = None,
        masked_positions: Optional[torch.Tensor] = None,
        num_items_in_batch=None,
    ):
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731 - [1, T] rows (see PackedMLMFeatures)
        out = UnpaddedMLM.forward(
            self,
            flat(input_ids),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            cu_seqlens=cu_seqlens,
            labels=flat(labels),
            max_seqlen=max_seqlen,
            seq_lengths=seq_lengths,
            masked_positions=masked_positions,
            loss_normalizer=num_items_in_batch,
        )
        # no mean_loss: Trainer gathers every output but the loss as a prediction, padding dim 1 across ranks
        return PretrainOutput(loss=out.loss, mlm_logits=out.mlm_logits[None], mlm_labels=out.mlm_labels[None])


class PackedMLMFeatures:
    """A ``Trainer`` collator: a list of features (mappings with ``input_ids``, optionally ``token_type_ids``) →
    one packed, masked row (:class:`~ds_bertopt.data.collate.PackedMLMCollator` with torch's RNG), one sequence per
    document: a feature that holds several documents (a ``group_texts`` block) is cut before every document start
    (:func:`~ds_bertopt.data.collate.document_lengths` at the tokenizer's ``[CLS]``/``<s>``), so attention stays
    within each document. The token-wise tensors are ``[1, T]``: Trainer takes a batch's first dimension for its
    size when it gathers evaluation losses and labels across ranks, which must agree (``T`` differs from rank to
    rank)."""

    def __init__(self, tokenizer, mlm_probability: float):
        self.packer = PackedMLMCollator(tokenizer, mlm_probability=mlm_probability, pad_multiple=1, max_length=1 << 30)
        self.document_start = document_start_id(tokenizer)
        start = self.document_start
        self.document_start_token = None if start is None else tokenizer.convert_ids_to_tokens(start)

    def __call__(self, features: list) -> dict:
        samples = []
        for feature in features:
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                raise ConfigError("model.unpadded: training examples must be mappings with input_ids")
            ids = list(feature["input_ids"])
            types = feature.get("token_type_ids")
            types = list(types) if types is not None else [0] * len(ids)
            start = 0
            for length in document_lengths(ids, self.document_start):
                piece = slice(start, start + length)
                samples.append({"input_ids": ids[piece], "token_type_ids": types[piece]})
                start += length
        batch = self.packer(samples, generator=None)
        for key in ("input_ids", "token_type_ids", "position_ids", "labels"):
            batch[key] = batch[key][None]
        return batch


def document_start_id(tokenizer) -> Optional[int]:
    """The token every tokenized document starts with (``[CLS]``, ``<s>``), or None when the tokenizer has none."""
    for name in ("cls_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return None


def packing_collator(collator) -> PackedMLMFeatures:
    """The packing collator that takes the place of the script's ``DataCollatorForLanguageModeling``."""
    from transformers import DataCollatorForLanguageModeling

    if not isinstance(collator, DataCollatorForLanguageModeling) or not collator.mlm:
        raise ConfigError(
            f"model.unpadded: the Trainer's data_collator is a {type(collator).__name__}; pass a "
            "DataCollatorForLanguageModeling (mlm=True): its tokenizer and mlm_probability pack and mask the batches"
        )
    if getattr(collator, "whole_word_mask", False):
        raise ConfigError("model.unpadded: whole-word masking is not supported; masking is per token (80/10/10)")
    return PackedMLMFeatures(collator.tokenizer, collator.mlm_probability)


__all__ = [
    "PackedMLMFeatures",
    "document_start_id",
    "TrainerUnpaddedMLM",
    "packing_collator",
]
