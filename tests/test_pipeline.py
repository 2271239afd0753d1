"""Corpus → tokenizer → held-out documents → variable-length sequences with recorded lengths."""

from __future__ import annotations

import numpy as np

from ds_bertopt.config import BertOptConfig, DataConfig
from ds_bertopt.data.pipeline import build_pretrain_data


def _cfg(corpus, cache_dir, **data):
    return BertOptConfig(
        data=DataConfig(train_files=(str(corpus),), cache_dir=str(cache_dir), tokenizer_vocab_size=2000, **data)
    )


def test_sequences_have_recorded_variable_lengths(small_corpus, cache_dir):
    data = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=64))
    lengths = np.array([len(ids) for ids in data.train["input_ids"]])
    assert np.array_equal(lengths, data.lengths)
    assert data.lengths.max() == 64 and data.lengths.min() < 32  # a real length mix
    tok = data.tokenizer
    for row in data.train.select(range(50)):
        assert row["input_ids"][0] == tok.cls_token_id and row["input_ids"][-1] == tok.sep_token_id
        assert tok.cls_token_id not in row["input_ids"][1:]
    assert len(tok) == 2000 and len(data.eval) > 0


def test_eval_documents_are_held_out(small_corpus, cache_dir):
    data = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=64, eval_fraction=0.1))
    train = {tuple(x) for x in data.train["input_ids"] if len(x) > 20}
    held = {tuple(x) for x in data.eval["input_ids"] if len(x) > 20}
    assert held and not (train & held)


def test_cached_second_build_is_identical(small_corpus, cache_dir):
    a = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=96))
    b = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=96))
    assert a.train._fingerprint == b.train._fingerprint
    assert a.train["input_ids"] == b.train["input_ids"]


def test_nsp_objective_builds_pairs(small_corpus, cache_dir):
    cfg = _cfg(small_corpus, cache_dir, max_seq_length=64)
    cfg = BertOptConfig(model=type(cfg.model)(objective="mlm_nsp"), data=cfg.data)
    data = build_pretrain_data(cfg)
    labels = np.array(data.train["next_sentence_label"])
    assert 0.2 < labels.mean() < 0.7
    sep = data.tokenizer.sep_token_id
    two_segments = sum(1 for ids in data.train["input_ids"] if ids.count(sep) == 2)
    assert two_segments > 0.8 * len(data.train)
