"""BERT sequence building: lengths, special tokens, nothing lost, NSP labels."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ds_bertopt.data.sequences import assemble, mlm_sequences, nsp_pairs, split_sentences

CLS, SEP = 2, 3


def test_split_sentences_paragraphs_and_punctuation():
    text = "First one. Second one!  Third?\n\nNew paragraph here. e.g. not split. Done 2 times."
    assert split_sentences(text) == [
        "First one.",
        "Second one!",
        "Third?",
        "New paragraph here. e.g. not split.",
        "Done 2 times.",
    ]
    assert split_sentences("\n\n  \n") == []


docs = st.lists(st.lists(st.integers(5, 999), min_size=0, max_size=300), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(doc=docs, max_len=st.integers(8, 128), short=st.floats(0, 1), seed=st.integers(0, 10**6))
def test_mlm_sequences_keep_every_token_in_order_within_budget(doc, max_len, short, seed):
    seqs = mlm_sequences(doc, max_seq_length=max_len, short_seq_prob=short, rng=random.Random(seed))
    assert all(1 <= len(s) <= max_len - 2 for s in seqs)
    assert [t for s in seqs for t in s] == [t for sent in doc for t in sent]  # over-long split, not dropped


def test_lengths_vary_and_short_sequences_appear():
    rng = random.Random(0)
    doc = [[7] * rng.randint(5, 40) for _ in range(400)]
    lengths = [len(s) for s in mlm_sequences(doc, max_seq_length=128, short_seq_prob=0.1, rng=rng)]
    assert max(lengths) == 126
    assert sum(1 for n in lengths if n < 90) >= 0.05 * len(lengths)


@settings(max_examples=150, deadline=None)
@given(doc=docs, other=docs, max_len=st.integers(8, 128), seed=st.integers(0, 10**6))
def test_nsp_pairs_fit_and_label(doc, other, max_len, seed):
    other = [s for s in other if s] or [[11]]
    pairs = nsp_pairs(
        doc, max_seq_length=max_len, short_seq_prob=0.1, rng=random.Random(seed), random_document=lambda: other
    )
    for a, b, label in pairs:
        assert len(a) + len(b) <= max_len - 3 and a
        assert label in (0, 1)
        ids, types = assemble(a, b, CLS, SEP)
        assert ids[0] == CLS and ids[-1] == SEP and len(ids) == len(types) <= max_len
        assert ids.count(SEP) == (2 if b else 1)
        assert types == [0] * (len(a) + 2) + [1] * (len(ids) - len(a) - 2)


def test_nsp_labels_are_balanced():
    rng = random.Random(1)
    labels = []
    for _ in range(300):
        doc = [[rng.randint(5, 99)] * rng.randint(5, 30) for _ in range(rng.randint(2, 30))]
        labels += [
            lab
            for _, _, lab in nsp_pairs(
                doc, max_seq_length=128, short_seq_prob=0.1, rng=rng, random_document=lambda: [[1] * 20] * 10
            )
        ]
    share = sum(labels) / len(labels)
    assert 0.4 < share < 0.65, share
