"""Shared helpers of the WTA-CRS / fine-tuning tests (imported by tests and spawned scripts)."""

from __future__ import annotations

import torch


def tiny_bert(
    hidden_dropout: float = 0.1,
    attention_dropout: float = 0.1,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    vocab: int = 200,
    num_labels: int = 2,
    attn: str = "sdpa",
):
    """A randomly initialised BertForSequenceClassification small enough for CPU tests."""
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        num_labels=num_labels,
        hidden_dropout_prob=hidden_dropout,
        attention_probs_dropout_prob=attention_dropout,
        attn_implementation=attn,
    )
    return BertForSequenceClassification(config)


def tiny_batch(batch: int = 4, seq: int = 16, vocab: int = 200, seed: int = 0, pad_from: int | None = None):
    """Random ids; rows >= 1 padded from position ``pad_from`` on when given."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_from is not None:
        mask[1:, pad_from:] = 0
        ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (batch,), generator=gen)}


def bias_statistic(estimates: torch.Tensor, exact: torch.Tensor) -> float:
    """‖mean − exact‖² / (Σ elementwise variance / T): about 1 for an unbiased estimator."""
    trials = estimates.shape[0]
    spread = estimates.double().var(0, unbiased=True).sum() / trials
    return float(((estimates.double().mean(0) - exact.double()) ** 2).sum() / spread)


# model_type -> config kwargs of a tiny random-init model (transformers' own config classes, no download)
_TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=200,
    max_position_embeddings=64,
)
TINY_FAMILIES = {
    "bert": dict(_TINY),
    "roberta": dict(_TINY, pad_token_id=1),
    "xlm-roberta": dict(_TINY, pad_token_id=1),
    "camembert": dict(_TINY, pad_token_id=1),
    "electra": dict(_TINY, embedding_size=16),
    "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=200, max_position_embeddings=64),
    "albert": dict(_TINY, embedding_size=16, hidden_act="gelu_new"),
    "mpnet": dict(_TINY),
    "deberta-v2": dict(
        _TINY,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
        pooler_hidden_size=32,
    ),
    "modernbert": dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=200,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        global_attn_every_n_layers=2,
        local_attention=8,
    ),
}
_DROPOUT_KEYS = {  # model_type -> the config keys of its dropouts
    "distilbert": ("dropout", "attention_dropout", "seq_classif_dropout"),
    "modernbert": ("attention_dropout", "mlp_dropout", "embedding_dropout", "classifier_dropout"),
    "albert": ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout_prob"),
}


def tiny_family(model_type: str, dropout: float = 0.0, seed: int = 0, attn: str | None = None, num_labels: int = 2):
    """A tiny random-init ``AutoModelForSequenceClassification`` of ``model_type`` (see ``TINY_FAMILIES``)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    kwargs = dict(TINY_FAMILIES[model_type], num_labels=num_labels)
    for key in _DROPOUT_KEYS.get(model_type, ("hidden_dropout_prob", "attention_probs_dropout_prob")):
        kwargs[key] = dropout
    if model_type == "deberta-v2":
        kwargs["pooler_dropout"] = dropout
    if attn is not None:
        kwargs["attn_implementation"] = attn
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(AutoConfig.for_model(model_type, **kwargs))
