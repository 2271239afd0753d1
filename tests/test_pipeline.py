"""Corpus → tokenizer → held-out documents → variable-length sequences with recorded lengths; the data's
fingerprint (what nodes compare), the deterministic default vocabulary, warnings for corpora too short."""

from __future__ import annotations

import json

import numpy as np

from ds_bertopt.config import BertOptConfig, DataConfig
from ds_bertopt.data.identity import DataFingerprint, disagreement
from ds_bertopt.data.pipeline import build_pretrain_data, length_warnings
from ds_bertopt.data.tokenizer import count_words, wordpiece_vocab


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


def test_the_default_vocabulary_is_a_function_of_the_corpus(small_corpus):
    """tokenizers' own WordPiece trainer gave a different vocabulary on every build (in one process too); ours is
    the same for the same words, in any order, so nodes with their own caches agree."""
    texts = [json.loads(line)["text"] for line in small_corpus.read_text().splitlines()]
    first = wordpiece_vocab(count_words(texts), 2000)
    assert wordpiece_vocab(count_words(texts), 2000) == first
    assert wordpiece_vocab(count_words(reversed(texts)), 2000) == first
    assert len(first) == 2000 and sorted(first.values()) == list(range(2000))
    assert [first[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert "##s" in first and "the" in first and not any(t.startswith("####") for t in first)


def test_short_corpora_and_tiny_evaluations_are_warned_about():
    """A corpus of one-word documents trained on 3-token sequences and printed "MLM accuracy 0.0000 -> 0.0476"."""
    words = np.full(500, 3)
    short, tiny = length_warnings(words, np.full(21, 3), 128, 0.15, specials=2)
    assert short.startswith("warning: the training sequences average 3.0 tokens, for data.max_seq_length 128")
    assert tiny.startswith("warning: an evaluation scores about 3 masked tokens (21 held-out sequences)")
    assert length_warnings(np.full(500, 100), np.full(40, 100), 128, 0.15, specials=2) == []


def test_nodes_that_built_other_data_are_named():
    same, other_vocab = (
        DataFingerprint("v1", "s1", "data.cache_dir /a"),
        DataFingerprint("v2", "s2", "data.cache_dir /b"),
    )
    views = [(0, 0, "host-a", same), (1, 0, "host-a", same), (2, 1, "host-b", DataFingerprint("v1", "s1", "x"))]
    assert disagreement(views) is None  # where it came from may differ; what it is may not
    assert disagreement([*views, (3, 1, "host-b", other_vocab)]) == (
        "node 1 (rank 3 on host-b, data.cache_dir /b) would train on other data than node 0 (rank 0 on host-a, "
        "data.cache_dir /a): its vocabulary differs (v2 vs v1); every node must read the same tokenizer and data: "
        "give data.tokenizer, or the same files, on every node"
    )
    assert "its samples differ (s2 vs s1" in disagreement([views[0], (1, 1, "b", DataFingerprint("v1", "s2", "y"))])


def test_the_data_fingerprint_follows_the_content(small_corpus, cache_dir, tmp_path):
    a = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=64))
    b = build_pretrain_data(_cfg(small_corpus, tmp_path / "another_cache", max_seq_length=64))
    assert a.fingerprint.identity() == b.fingerprint.identity()  # rebuilt from scratch elsewhere: the same data
    assert a.fingerprint.where != b.fingerprint.where
    c = build_pretrain_data(_cfg(small_corpus, cache_dir, max_seq_length=64, seed=7))
    assert c.fingerprint.vocabulary == a.fingerprint.vocabulary and c.fingerprint.samples != a.fingerprint.samples
