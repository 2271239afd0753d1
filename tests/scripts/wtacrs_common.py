"""Shared helpers of the WTA-CRS / fine-tuning tests (imported by tests and spawned scripts)."""
from __future__ import annotations

import torch


def tiny_bert(hidden_dropout: float = 0.1, attention_dropout: float = 0.1, seed: int = 0, layers: int = 2,
              hidden: int = 32, vocab: int = 200, num_labels: int = 2, attn: str = "sdpa"):
    """A randomly initialised BertForSequenceClassification small enough for CPU tests."""
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=64, num_labels=num_labels,
                        hidden_dropout_prob=hidden_dropout, attention_probs_dropout_prob=attention_dropout,
                        attn_implementation=attn)
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
