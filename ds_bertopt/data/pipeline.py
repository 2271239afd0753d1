"""Corpus → tokenizer → held-out split → BERT sequences with recorded lengths (cached).

All heavy steps are ``datasets.map`` calls with explicit fingerprints, so their results are cached
under ``cache_dir`` and a second run (or another rank) reuses them. On every node the local rank 0
builds first under a file lock while the other ranks wait at a barrier, then they read the cache.
The result carries its :class:`~ds_bertopt.data.identity.DataFingerprint` (compared across nodes at
start-up and kept in checkpoints), the records skipped as unusable, and :func:`length_warnings`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
from filelock import FileLock

from ..dist import barrier
from ..errors import DataError
from . import sequences
from .corpus import load_documents
from .identity import DataFingerprint, columns_digest, vocabulary_digest
from .parallel import available_cores, default_num_proc, parallel_map
from .skipped import Skipped
from .tokenizer import get_tokenizer

PIPELINE_VERSION = "1"  # bump when the sequence-building code changes what it produces
_MAP_BATCH = 256


@dataclass
class PretrainData:
    train: "object"
    """``datasets.Dataset`` with ``input_ids``, ``token_type_ids``, ``next_sentence_label``, ``length``."""
    eval: "object"
    """Held-out sequences (from held-out documents), same columns."""
    tokenizer: "object"
    """A Hugging Face fast tokenizer."""
    lengths: np.ndarray
    """Token count of every training sequence (specials included), aligned with ``train``."""
    source: str
    """Human-readable description of the corpus."""
    skipped: Skipped
    """Corpus records skipped as unusable (counted, named)."""
    fingerprint: DataFingerprint
    """Digests of the vocabulary and the sequences, and where they came from."""


def _fingerprint(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def byte_level(tokenizer) -> bool:
    """A byte-level BPE tokenizer (RoBERTa, ModernBERT): a word after a space is another token than at the start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return "ByteLevel" in repr(getattr(backend, "pre_tokenizer", None))


def _tokenize_batch(batch, tokenizer, space_prefix: bool = False, offset: int = 0):  # noqa: ARG001 - parallel_map's
    """Every document's sentences as token ids. ``space_prefix`` (byte-level BPE): each sentence but a document's
    first is tokenized as it follows a space in running text ("ĠThe", not "The"), as the checkpoint saw it."""
    per_doc = [sequences.split_sentences(text) for text in batch["text"]]
    if space_prefix:
        per_doc = [[s if i == 0 else " " + s for i, s in enumerate(doc)] for doc in per_doc]
    flat = [s for doc in per_doc for s in doc]
    # verbose=False: a sentence longer than the model is cut into sequences later; no warning about its length
    ids = tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
    out, pos = [], 0
    for doc in per_doc:
        out.append([t for t in ids[pos : pos + len(doc)] if t])
        pos += len(doc)
    return {"sentences": out}


def _pick(docs, others, rng):
    return docs[rng.choice(others)]


def _pretokenized_batch(batch, special_ids, vocab_size: int, offset: int = 0):  # noqa: ARG001 - see _tokenize_batch
    """Rows of token ids (a ``datasets`` directory that holds ``input_ids``): each row is one document of one
    "sentence", special tokens dropped (the sequence builder adds its own)."""
    out = []
    for ids in batch["input_ids"]:
        if ids and max(ids) >= vocab_size:
            raise DataError(
                f"data.dataset: token id {max(ids)} is outside the tokenizer's vocabulary ({vocab_size}); give "
                "data.tokenizer the tokenizer that made these input_ids"
            )
        kept = [t for t in ids if t not in special_ids]
        out.append([kept] if kept else [])
    return {"sentences": out}


def _instance_batch(batch, indices, *, max_seq_length, short_seq_prob, nsp, seed, cls_id, sep_id, offset: int = 0):
    docs = batch["sentences"]
    rng = random.Random(seed * 1_000_003 + offset + indices[0])  # the absolute index: any process count, same draws
    out = {"input_ids": [], "token_type_ids": [], "next_sentence_label": [], "length": []}
    for d, doc in enumerate(docs):
        if not doc:
            continue
        if nsp:
            others = [j for j in range(len(docs)) if j != d and docs[j]]
            random_document = functools.partial(_pick, docs, others, rng) if others else None
            pairs = sequences.nsp_pairs(
                doc,
                max_seq_length=max_seq_length,
                short_seq_prob=short_seq_prob,
                rng=rng,
                random_document=random_document,
            )
        else:
            pairs = [
                (tokens, [], 0)
                for tokens in sequences.mlm_sequences(
                    doc, max_seq_length=max_seq_length, short_seq_prob=short_seq_prob, rng=rng
                )
            ]
        for tokens_a, tokens_b, label in pairs:
            ids, types = sequences.assemble(tokens_a, tokens_b, cls_id, sep_id)
            out["input_ids"].append(ids)
            out["token_type_ids"].append(types)
            out["next_sentence_label"].append(label)
            out["length"].append(len(ids))
    return out


TEXT_SAMPLE = 1000
"""Documents read to estimate a corpus's size for the default ``data.num_proc``."""


def text_bytes(documents) -> int:
    """The corpus's size in bytes of text (token ids count 4 bytes each), estimated from its first documents."""
    sample = documents.select(range(min(len(documents), TEXT_SAMPLE)))
    if "input_ids" in documents.column_names:
        size = 4 * sum(len(ids) for ids in sample["input_ids"])
    else:
        size = sum(len(text.encode("utf-8")) for text in sample["text"])
    return size * len(documents) // max(1, len(sample))


def build_sequences(
    documents,
    tokenizer,
    *,
    max_seq_length: int,
    short_seq_prob: float,
    nsp: bool,
    seed: int,
    cache_dir: str,
    split: str,
    num_proc: Optional[int] = None,
):
    """Tokenize documents into sentences (or take their ``input_ids``), then pack them into BERT sequences (both
    steps cached, both over ``num_proc`` processes: :func:`~.parallel.parallel_map`, the same rows for any count)."""
    from datasets import Features, List, Value

    # the types datasets infers for these columns, given so that no part of a parallel map pays the inference (a
    # fixed cost per map call that scans its first batch)
    tokenized_features = Features({"sentences": List(List(Value("int64")))})
    sequence_features = Features(
        {
            "input_ids": List(Value("int32")),
            "token_type_ids": List(Value("int8")),
            "next_sentence_label": Value("int64"),
            "length": Value("int64"),
        }
    )
    tok_id = vocabulary_digest(tokenizer)
    cache = os.path.join(cache_dir, "sequences")
    os.makedirs(cache, exist_ok=True)
    num_proc = num_proc or default_num_proc(text_bytes(documents), available_cores())
    common = dict(num_proc=num_proc, batch_size=_MAP_BATCH, cache_dir=cache)
    if "input_ids" in documents.column_names:
        fp_tok = _fingerprint("pretokenized", PIPELINE_VERSION, documents._fingerprint, tok_id)
        tokenized = parallel_map(
            documents,
            _pretokenized_batch,
            align=1,
            fingerprint=fp_tok,
            fn_kwargs={"special_ids": frozenset(tokenizer.all_special_ids), "vocab_size": len(tokenizer)},
            remove_columns=["input_ids"],
            features=tokenized_features,
            desc=f"taking the {split} documents' input_ids",
            **common,
        )
    else:
        space = byte_level(tokenizer)  # (a WordPiece vocabulary's caches keep their fingerprint)
        fp_tok = _fingerprint("tok", PIPELINE_VERSION, documents._fingerprint, tok_id, *(["space"] if space else []))
        tokenized = parallel_map(
            documents,
            _tokenize_batch,
            align=1,  # per document: any cut gives the same rows
            fingerprint=fp_tok,
            fn_kwargs={"tokenizer": tokenizer, "space_prefix": space},
            remove_columns=["text"],
            features=tokenized_features,
            desc=f"tokenizing {split} documents",
            **common,
        )
    fp_seq = _fingerprint("seq", PIPELINE_VERSION, fp_tok, max_seq_length, short_seq_prob, nsp, seed)
    return parallel_map(
        tokenized,
        _instance_batch,
        align=_MAP_BATCH,  # draws are seeded per map batch: cut only where one process's batches start
        fingerprint=fp_seq,
        with_indices=True,
        remove_columns=["sentences"],
        features=sequence_features,
        fn_kwargs=dict(
            max_seq_length=max_seq_length,
            short_seq_prob=short_seq_prob,
            nsp=nsp,
            seed=seed,
            cls_id=tokenizer.cls_token_id,
            sep_id=tokenizer.sep_token_id,
        ),
        desc=f"building {split} sequences",
        **common,
    )


def split_documents(documents, eval_fraction: float, seed: int):
    """Hold out ``max(1, round(fraction·n))`` whole documents (so no text leaks into eval)."""
    n = len(documents)
    n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    order = np.random.default_rng(seed).permutation(n)
    eval_idx = np.sort(order[:n_eval])
    train_idx = np.sort(order[n_eval:])
    return documents.select(train_idx), documents.select(eval_idx)


def _build(cfg, cache_dir: str) -> PretrainData:
    data_cfg, model_cfg = cfg.data, cfg.model
    skipped = Skipped("records")
    documents = load_documents(data_cfg, cache_dir, skipped)
    source = data_cfg.dataset or (
        ", ".join(data_cfg.train_files) if data_cfg.train_files else "embedded corpus (Python stdlib docstrings)"
    )
    tokenizer = get_tokenizer(data_cfg, documents, cache_dir)
    train_docs, eval_docs = split_documents(documents, data_cfg.eval_fraction, data_cfg.seed)
    common = dict(
        max_seq_length=data_cfg.max_seq_length,
        short_seq_prob=data_cfg.short_seq_prob,
        nsp=model_cfg.objective == "mlm_nsp",
        seed=data_cfg.seed,
        cache_dir=cache_dir,
        num_proc=data_cfg.num_proc,
    )
    train = build_sequences(train_docs, tokenizer, split="train", **common)
    evaluation = build_sequences(eval_docs, tokenizer, split="eval", **common)
    if len(train) == 0:
        raise DataError(f"corpus {source} produced no training sequences")
    if len(evaluation) > data_cfg.max_eval_samples:
        evaluation = evaluation.select(range(data_cfg.max_eval_samples))
    lengths = np.asarray(train["length"], dtype=np.int32)
    where = f"data.cache_dir {cache_dir}" + (f", data.tokenizer {data_cfg.tokenizer}" if data_cfg.tokenizer else "")
    samples = columns_digest(train, ("input_ids", "token_type_ids", "next_sentence_label"))
    samples += "-" + columns_digest(evaluation, ("input_ids", "token_type_ids", "next_sentence_label"))
    fingerprint = DataFingerprint(vocabulary_digest(tokenizer), samples, where)
    return PretrainData(train, evaluation, tokenizer, lengths, source, skipped, fingerprint)


SHORT_SEQUENCES = 1 / 8
"""Training sequences averaging less than this fraction of ``max_seq_length`` are warned about."""
MIN_EVAL_TARGETS = 100
"""An evaluation scoring fewer masked tokens than this is warned about: its accuracy moves in steps of 1 %."""


def length_warnings(
    lengths: np.ndarray, eval_lengths: np.ndarray, max_seq_length: int, mlm_probability: float, specials: int
) -> list[str]:
    """Warnings for a corpus too short for its sequence length, and for an evaluation too small to mean much."""
    out = []
    mean = float(lengths.mean())
    if mean < SHORT_SEQUENCES * max_seq_length:
        out.append(
            f"warning: the training sequences average {mean:.1f} tokens, for data.max_seq_length {max_seq_length}: "
            "the documents are very short (one line or a few words each?), and BERT learns little from them; "
            'check data.txt_format ("line" makes every line a document) and data.text_field'
        )
    targets = float(np.clip(eval_lengths - specials, 0, None).sum()) * mlm_probability
    if targets < MIN_EVAL_TARGETS:
        out.append(
            f"warning: an evaluation scores about {targets:.0f} masked tokens ({len(eval_lengths)} held-out "
            "sequences): its accuracy is mostly noise; hold out more documents (data.eval_fraction) or use a "
            "longer corpus"
        )
    return out


def build_pretrain_data(cfg, local_rank: int = 0, distributed: bool = False) -> PretrainData:
    """Build (local rank 0 of each node first, under a file lock) or load from cache."""

    cache_dir = os.path.abspath(os.path.expanduser(cfg.data.cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    if distributed and local_rank != 0:
        barrier()
    with FileLock(os.path.join(cache_dir, ".build.lock")):
        data = _build(cfg, cache_dir)
    if distributed and local_rank == 0:
        barrier()
    return data
