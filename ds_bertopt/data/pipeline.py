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

import numpy as np
from filelock import FileLock

from ..dist import barrier
from ..errors import DataError
from . import sequences
from .corpus import load_documents
from .identity import DataFingerprint, columns_digest, vocabulary_digest
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


def _tokenize_batch(batch, tokenizer):
    per_doc = [sequences.split_sentences(text) for text in batch["text"]]
    flat = [s for doc in per_doc for s in doc]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out, pos = [], 0
    for doc in per_doc:
        out.append([t for t in ids[pos : pos + len(doc)] if t])
        pos += len(doc)
    return {"sentences": out}


def _pick(docs, others, rng):
    return docs[rng.choice(others)]


def _instance_batch(batch, indices, *, max_seq_length, short_seq_prob, nsp, seed, cls_id, sep_id):
    docs = batch["sentences"]
    rng = random.Random(seed * 1_000_003 + indices[0])
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
):
    """Tokenize documents into sentences, then pack them into BERT sequences (both steps cached)."""
    tok_id = vocabulary_digest(tokenizer)
    cache = os.path.join(cache_dir, "sequences")
    os.makedirs(cache, exist_ok=True)
    fp_tok = _fingerprint("tok", PIPELINE_VERSION, documents._fingerprint, tok_id)
    tokenized = documents.map(
        _tokenize_batch,
        batched=True,
        batch_size=_MAP_BATCH,
        remove_columns=["text"],
        fn_kwargs={"tokenizer": tokenizer},
        new_fingerprint=fp_tok,
        cache_file_name=os.path.join(cache, f"{fp_tok}.arrow"),
        desc=f"tokenizing {split} documents",
    )
    fp_seq = _fingerprint("seq", PIPELINE_VERSION, fp_tok, max_seq_length, short_seq_prob, nsp, seed)
    return tokenized.map(
        _instance_batch,
        batched=True,
        batch_size=_MAP_BATCH,
        with_indices=True,
        remove_columns=["sentences"],
        fn_kwargs=dict(
            max_seq_length=max_seq_length,
            short_seq_prob=short_seq_prob,
            nsp=nsp,
            seed=seed,
            cls_id=tokenizer.cls_token_id,
            sep_id=tokenizer.sep_token_id,
        ),
        new_fingerprint=fp_seq,
        cache_file_name=os.path.join(cache, f"{fp_seq}.arrow"),
        desc=f"building {split} sequences",
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
