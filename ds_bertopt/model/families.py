"""The BERT-family architectures we pretrain with masked LM, and what differs between them (transformers 5.24).

One :class:`MlmFamily` per architecture: its masked-LM class, its MLM head (run only at the masked positions),
which state-dict prefixes are that head (a checkpoint without them gets a new head) and which belong to other
heads a checkpoint may carry (pooler, next-sentence, classifiers: dropped, and said), where its position ids
start (RoBERTa's copies count from ``padding_idx + 1``), whether its base model takes token types, and whether it
can run unpadded at all: every family here calls transformers' attention interface with plain softmax
attention (``ALL_ATTENTION_FUNCTIONS``), which :mod:`.unpadded` replaces by attention per packed sequence, except
DeBERTa, whose disentangled relative attention computes its own scores (it trains padded).

The fine-tuning registry (:mod:`ds_bertopt.wtacrs.families`) answers another question (where the linears the
memory kit swaps live) and stays separate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigError


def _bert_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.cls.predictions(hidden)


def _roberta_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(hidden)


def _electra_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.generator_lm_head(model.generator_predictions(hidden))


def _distilbert_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # DistilBertForMaskedLM.forward's four lines (the head is not a module of its own)
    return model.vocab_projector(model.vocab_layer_norm(model.activation(model.vocab_transform(hidden))))


def _modernbert_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.decoder(model.head(hidden))


def _deberta_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if model.legacy:
        return model.cls(hidden)
    return model.lm_predictions(hidden, model.deberta.embeddings.word_embeddings)


def _no_offset(config) -> int:  # noqa: ARG001 - the signature of MlmFamily.position_offset
    return 0


def _after_padding_idx(config) -> int:
    """RoBERTa's ``create_position_ids_from_input_ids``: a sequence's first token has position ``padding_idx + 1``."""
    return config.pad_token_id + 1


@dataclass(frozen=True)
class MlmFamily:
    name: str
    """Shown in messages (``roberta``, ``modernbert``, …)."""
    model_types: tuple[str, ...]
    """``config.model_type`` values of this family."""
    mlm_class: str
    """The transformers masked-LM class (a checkpoint of this family loads into it)."""
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """``head(model, hidden [M, hidden]) -> logits [M, vocab]``: the MLM head on the masked positions only."""
    head_prefixes: tuple[str, ...]
    """State-dict prefixes (after the base model's) of the MLM head: a checkpoint without them gets a new head."""
    dropped_prefixes: tuple[str, ...]
    """Prefixes of other heads a checkpoint of this family may carry (its pooler, classifiers): not used, dropped."""
    position_offset: Callable[[object], int] = _no_offset
    """``position_offset(config)``: the position id of a sequence's first token (0; RoBERTa: ``padding_idx + 1``)."""
    token_types: bool = True
    """The base model takes ``token_type_ids``."""
    attention_dropout: str = "attention_probs_dropout_prob"
    """Config attribute of the attention-probability dropout."""
    pretraining_class: Optional[str] = None
    """The class with a next-sentence head too (``objective: mlm_nsp``); ``None``: MLM only."""
    unpadded_blocker: Optional[str] = None
    """Why this family cannot run unpadded (it then trains padded); ``None``: it can."""
    sdpa: bool = True
    """transformers runs its attention through SDPA (else eager only)."""
    layer_type_masks: bool = False
    """The base model takes ``attention_mask`` as a mapping per layer type (ModernBERT: full and sliding)."""
    residual_norm_blocks: tuple[str, ...] = ()
    """Module classes whose forward is ``LayerNorm(dropout(dense(h)) + input)`` (BERT's ``BertSelfOutput`` and
    ``BertOutput``): their dropout fused with the residual add under ``model.fused_dropout``
    (:func:`.fused.fuse_encoder`)."""

    def max_tokens(self, config) -> int:
        """The longest sequence its position table takes."""
        return config.max_position_embeddings - self.position_offset(config)


_BERT_DROPPED = ("pooler.", "cls.seq_relationship.", "classifier.", "qa_outputs.")


def _bert_layout(prefix: str) -> dict:
    """The residual blocks of a family whose layer is BERT's (``<prefix>SelfOutput``, ``<prefix>Output``);
    DistilBERT's and ModernBERT's layers differ (only their dropout modules are swapped)."""
    return {"residual_norm_blocks": (f"{prefix}SelfOutput", f"{prefix}Output")}


BERT = MlmFamily(
    "bert",
    ("bert",),
    "BertForMaskedLM",
    _bert_head,
    head_prefixes=("cls.predictions.",),
    dropped_prefixes=_BERT_DROPPED,
    pretraining_class="BertForPreTraining",
    **_bert_layout("Bert"),
)
ROBERTA = MlmFamily(
    "roberta",
    ("roberta",),
    "RobertaForMaskedLM",
    _roberta_head,
    head_prefixes=("lm_head.",),
    dropped_prefixes=("pooler.", "classifier.", "qa_outputs."),
    position_offset=_after_padding_idx,
    **_bert_layout("Roberta"),
)
XLM_ROBERTA = MlmFamily(
    "xlm-roberta",
    ("xlm-roberta",),
    "XLMRobertaForMaskedLM",
    _roberta_head,
    ROBERTA.head_prefixes,
    ROBERTA.dropped_prefixes,
    _after_padding_idx,
    **_bert_layout("XLMRoberta"),
)
CAMEMBERT = MlmFamily(
    "camembert",
    ("camembert",),
    "CamembertForMaskedLM",
    _roberta_head,
    ROBERTA.head_prefixes,
    ROBERTA.dropped_prefixes,
    _after_padding_idx,
    **_bert_layout("Camembert"),
)
DISTILBERT = MlmFamily(
    "distilbert",
    ("distilbert",),
    "DistilBertForMaskedLM",
    _distilbert_head,
    head_prefixes=("vocab_transform.", "vocab_layer_norm.", "vocab_projector."),
    dropped_prefixes=("pre_classifier.", "classifier.", "qa_outputs."),
    token_types=False,
    attention_dropout="attention_dropout",
)
ELECTRA = MlmFamily(
    "electra",
    ("electra",),
    "ElectraForMaskedLM",
    _electra_head,
    head_prefixes=("generator_predictions.", "generator_lm_head."),
    dropped_prefixes=("discriminator_predictions.", "classifier.", "qa_outputs."),
    **_bert_layout("Electra"),
)
MODERNBERT = MlmFamily(
    "modernbert",
    ("modernbert",),
    "ModernBertForMaskedLM",
    _modernbert_head,
    head_prefixes=("head.", "decoder."),
    dropped_prefixes=("classifier.", "drop."),
    token_types=False,
    attention_dropout="attention_dropout",
    layer_type_masks=True,
)
_RELATIVE = "its disentangled relative attention computes its own scores (no attention interface to replace)"
DEBERTA = MlmFamily(
    "deberta",
    ("deberta",),
    "DebertaForMaskedLM",
    _deberta_head,
    head_prefixes=("lm_predictions.", "cls."),
    dropped_prefixes=("pooler.", "classifier."),
    unpadded_blocker=_RELATIVE,
    sdpa=False,
)
DEBERTA_V2 = MlmFamily(
    "deberta-v2",
    ("deberta-v2",),
    "DebertaV2ForMaskedLM",
    _deberta_head,
    DEBERTA.head_prefixes,
    DEBERTA.dropped_prefixes,
    unpadded_blocker=_RELATIVE,
    sdpa=False,
)

FAMILIES = (BERT, ROBERTA, XLM_ROBERTA, CAMEMBERT, DISTILBERT, ELECTRA, MODERNBERT, DEBERTA, DEBERTA_V2)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> str:
    return ", ".join(_BY_MODEL_TYPE)


def family_of_type(model_type: Optional[str], where: str) -> MlmFamily:
    """The family of a ``config.model_type``, or a one-line error naming ``where`` and what is supported."""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        what = f"a {model_type!r} checkpoint" if model_type else "a checkpoint without a model_type"
        raise ConfigError(f"{where} is {what}; masked-LM pretraining takes {supported_model_types()}")
    return family


def family_of(model: nn.Module) -> MlmFamily:
    """The family of a transformers masked-LM model (``TypeError`` for anything else)."""
    family = _BY_MODEL_TYPE.get(getattr(getattr(model, "config", None), "model_type", None))
    classes = (family.mlm_class, family.pretraining_class) if family is not None else ()
    if family is None or type(model).__name__ not in classes:
        supported = ", ".join(f.mlm_class for f in FAMILIES)
        raise TypeError(f"expected a masked-LM model of a known family ({supported}), got {type(model).__name__}")
    return family


def model_class(family: MlmFamily, nsp: bool) -> type:
    """The transformers class to build or load (``nsp``: MLM + next-sentence, BERT only)."""
    import transformers

    if nsp and family.pretraining_class is None:
        raise ConfigError(
            f'model.objective: "mlm_nsp" needs a BERT checkpoint (a next-sentence head); {family.name} pretrains '
            'with "mlm"'
        )
    return getattr(transformers, family.pretraining_class if nsp else family.mlm_class)


def strip_base_prefix(key: str, base_prefix: str) -> str:
    return key[len(base_prefix) + 1 :] if key.startswith(base_prefix + ".") else key


def under(key: str, prefixes: tuple[str, ...], base_prefix: str) -> bool:
    """``key`` (with or without the base model's prefix) lies under one of ``prefixes``."""
    return strip_base_prefix(key, base_prefix).startswith(prefixes)


__all__ = [
    "FAMILIES",
    "MlmFamily",
    "family_of",
    "family_of_type",
    "model_class",
    "supported_model_types",
    "under",
]
