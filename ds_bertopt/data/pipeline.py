"""Corpus → tokenizer → held-out split → BERT sequences with recorded lengths: built once, then opened in seconds.

The life cycle (``docs/data.md``):

* **Build.** The documents are read (:mod:`.corpus`); the default tokenizer is trained on word counts taken over
  ``data.num_proc`` processes (:mod:`.tokenizer`); each split's documents are tokenized and cut into sequences in
  one pass per map batch, in parts over the processes (:mod:`.parallel`: the same rows for any count) and over the
  nodes that share ``data.cache_dir`` (:mod:`.crew`: each node a disjoint set of the parts). The stored fingerprint
  is written last (:mod:`.manifest`).
* **Restart.** The stored fingerprint is checked cheaply and the Arrow files are memory-mapped: the lengths are one
  Arrow column read zero-copy; no Python runs per row.
* **In a job.** Each node's local rank 0 opens or builds; every other rank waits on the job's store, not in a
  collective (:mod:`ds_bertopt.handoff`: progress lines every 30 s, the builder's own error on every rank), then
  opens what was built. No rank leaves before every node has its data, so the collectives that follow (the ranks
  compare the stored digests, :func:`~.identity.check_same_data`) start together.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import pickle
import random
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
from filelock import FileLock, Timeout

from ..handoff import Work, job_store, wait_for
from ..errors import DataError
from ..log import print0, print_all
from . import manifest, sequences
from .corpus import embedded_corpus_path, expand_patterns, load_documents
from .crew import Crew, describe_storage, sharing_nodes, work_labels, work_name
from .identity import DataFingerprint, vocabulary_digest
from .parallel import available_cores, default_num_proc, parallel_map
from .skipped import Skipped
from .tokenizer import count_words_parallel, load_tokenizer, save_wordpiece, trained_dir

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
    eval_lengths: np.ndarray
    """Token count of every held-out sequence."""
    opened: str = ""
    """How the data was obtained, for the log (built, or opened from the stored build)."""


def _fingerprint(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def byte_level(tokenizer) -> bool:
    """A byte-level BPE tokenizer (RoBERTa, ModernBERT): a word after a space is another token than at the start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return "ByteLevel" in repr(getattr(backend, "pre_tokenizer", None))


def _encoder(tokenizer):
    """The tokenizer's Rust backend, copied (the caller's keeps its settings) and set as ``tokenizer(texts,
    add_special_tokens=False)`` sets it: no truncation, no padding (transformers' ``_encode_plus`` calls the same
    ``encode_batch``; ``encode_batch_fast`` gives the same ids without computing offsets)."""
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    encoder.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return encoder


def _tokenize_batch(batch, tokenizer, space_prefix: bool = False, offset: int = 0, encoder=None):  # noqa: ARG001
    """Every document's sentences as token ids. ``space_prefix`` (byte-level BPE): each sentence but a document's
    first is tokenized as it follows a space in running text ("ĠThe", not "The"), as the checkpoint saw it.
    ``encoder``: :func:`_encoder` of ``tokenizer``, made once by the caller (``offset``: parallel_map's)."""
    per_doc = [sequences.split_sentences(text) for text in batch["text"]]
    if space_prefix:
        per_doc = [[s if i == 0 else " " + s for i, s in enumerate(doc)] for doc in per_doc]
    flat = [s for doc in per_doc for s in doc]
    encoder = encoder or _encoder(tokenizer)
    ids = [e.ids for e in encoder.encode_batch_fast(flat, add_special_tokens=False)] if flat else []
    out, pos = [], 0
    for doc in per_doc:
        out.append(list(filter(None, ids[pos : pos + len(doc)])))  # sentences that gave no token are dropped
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
    """One map batch of tokenized documents (``sentences``) as BERT sequences: an Arrow table (its token types made
    in numpy, not per token in Python)."""
    import pyarrow as pa

    docs = batch["sentences"]
    rng = random.Random(seed * 1_000_003 + offset + indices[0])  # the absolute index: any process count, same draws
    ids_out, labels, second = [], [], []
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
            ids_out.append(sequences.assemble_ids(tokens_a, tokens_b, cls_id, sep_id))
            labels.append(label)
            second.append(len(tokens_b) + 1 if tokens_b else 0)
    input_ids = pa.array(ids_out, type=pa.list_(pa.int32()))
    lengths = np.diff(input_ids.offsets.to_numpy()).astype(np.int64)
    types = sequences.token_types(lengths, np.asarray(second, dtype=np.int64))
    return pa.table(
        {
            "input_ids": input_ids,
            "token_type_ids": pa.ListArray.from_arrays(input_ids.offsets, pa.array(types, type=pa.int8())),
            "next_sentence_label": pa.array(labels, type=pa.int64()),
            "length": pa.array(lengths, type=pa.int64()),
        }
    )


def _sequence_batch(batch, indices, *, source: dict, build: dict, offset: int = 0):
    """One map batch of documents (text, or ``input_ids``) straight to BERT sequences: tokenizing, then
    :func:`_instance_batch`, in one pass (no tokenized copy of the corpus is written)."""
    if "input_ids" in batch:
        sentences = _pretokenized_batch(batch, **source)["sentences"]
    else:
        sentences = _tokenize_batch(batch, None, **source)["sentences"]
    return _instance_batch({"sentences": sentences}, indices, offset=offset, **build)


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
    share=None,
    progress=None,
):
    """Tokenize documents into sentences (or take their ``input_ids``) and pack them into BERT sequences, one map
    batch at a time, cached, over ``num_proc`` processes (:func:`~.parallel.parallel_map`: the same rows for any
    count) and, with ``share``, over the nodes of a :class:`~.crew.Crew`."""
    from datasets import Features, List, Value

    # the types datasets infers for these columns, given so that no part of a parallel map pays the inference (a
    # fixed cost per map call that scans its first batch)
    features = Features(
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
    build = dict(
        max_seq_length=max_seq_length,
        short_seq_prob=short_seq_prob,
        nsp=nsp,
        seed=seed,
        cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id,
    )
    if "input_ids" in documents.column_names:
        source = {"special_ids": frozenset(tokenizer.all_special_ids), "vocab_size": len(tokenizer)}
        kind, what, inputs = ["pretokenized"], f"taking the {split} documents' input_ids", "input_ids"
    else:
        space = byte_level(tokenizer)  # (a WordPiece vocabulary's caches keep their fingerprint)
        source = {"encoder": _encoder(tokenizer), "space_prefix": space}
        kind, what, inputs = ["space"] if space else [], f"tokenizing {split} documents into sequences", "text"
    fingerprint = _fingerprint(
        "sequences", PIPELINE_VERSION, documents._fingerprint, tok_id, *kind, max_seq_length, short_seq_prob, nsp, seed
    )
    return parallel_map(
        documents,
        _sequence_batch,
        num_proc=num_proc,
        align=_MAP_BATCH,  # draws are seeded per map batch: cut only where one process's batches start
        batch_size=_MAP_BATCH,
        fingerprint=fingerprint,
        cache_dir=cache,
        with_indices=True,
        remove_columns=[inputs],
        features=features,
        fn_kwargs={"source": source, "build": build},
        desc=what,
        share=share,
        progress=progress,
    )


def split_documents(documents, eval_fraction: float, seed: int):
    """Hold out ``max(1, round(fraction·n))`` whole documents (so no text leaks into eval)."""
    n = len(documents)
    n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    order = np.random.default_rng(seed).permutation(n)
    eval_idx = np.sort(order[:n_eval])
    train_idx = np.sort(order[n_eval:])
    return documents.select(train_idx), documents.select(eval_idx)


# --- the stored build: its key, its inputs, opening it -------------------------------------------------------
def _location(name: Optional[str]) -> Optional[str]:
    """A path as an absolute path (a name, e.g. of a tokenizer in the Hugging Face cache, as it is)."""
    if name is None:
        return None
    path = os.path.expanduser(name)
    return os.path.abspath(path) if os.path.exists(path) or os.sep in name else name


def settings_key(cfg) -> tuple[str, dict]:
    """The settings that decide the sequences (not ``data.num_proc``: any count builds the same), and their digest:
    the stored build's name."""
    d = cfg.data
    settings = {
        "pipeline": PIPELINE_VERSION,
        "train_files": [_location(p) for p in d.train_files],
        "dataset": _location(d.dataset),
        "dataset_split": d.dataset_split if d.dataset else None,
        "text_field": d.text_field,
        "txt_format": d.txt_format,
        "tokenizer": _location(d.tokenizer),
        "tokenizer_vocab_size": None if d.tokenizer else d.tokenizer_vocab_size,
        "max_seq_length": d.max_seq_length,
        "short_seq_prob": d.short_seq_prob,
        "eval_fraction": d.eval_fraction,
        "max_eval_samples": d.max_eval_samples,
        "max_documents": d.max_documents,
        "max_skipped_fraction": d.max_skipped_fraction,
        "seed": d.seed,
        "nsp": cfg.model.objective == "mlm_nsp",
    }
    return _fingerprint(settings), settings


def corpus_inputs(data_cfg, cache_dir: str) -> list[dict]:
    """Size and modification time of every input file: the corpus files, the extracted embedded corpus, or the files
    of a ``datasets`` directory (a dataset from the Hugging Face cache is not stat'ed: offline, it does not change)."""
    if data_cfg.dataset:
        root = os.path.expanduser(data_cfg.dataset)
        paths = (
            sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files) if os.path.isdir(root) else []
        )
    elif data_cfg.train_files:
        paths = expand_patterns(data_cfg.train_files)
    else:
        paths = [embedded_corpus_path(cache_dir)]
    return manifest.file_stats([os.path.abspath(p) for p in paths])


def _describe_source(data_cfg) -> str:
    return data_cfg.dataset or (
        ", ".join(data_cfg.train_files) if data_cfg.train_files else "embedded corpus (Python stdlib docstrings)"
    )


def _open_stored(cfg, cache_dir: str, key: str, resample: bool) -> PretrainData:
    """The stored build of ``key``, checked (:func:`~.manifest.verify`); :class:`~.manifest.Stale` says why not."""
    data_cfg = cfg.data
    started = time.perf_counter()
    stored = manifest.read(cache_dir, key)
    train, evaluation, lengths = manifest.verify(stored, cache_dir, corpus_inputs(data_cfg, cache_dir), resample)
    location = stored["tokenizer"]
    tokenizer = load_tokenizer(
        location if os.path.isabs(location) or data_cfg.tokenizer else os.path.join(cache_dir, location)
    )
    if vocabulary_digest(tokenizer) != stored["vocabulary"]:
        raise manifest.Stale(f"the tokenizer {location} changed since the cache was built (another vocabulary)")
    where = f"data.cache_dir {cache_dir}" + (f", data.tokenizer {data_cfg.tokenizer}" if data_cfg.tokenizer else "")
    eval_lengths = evaluation.with_format("arrow")[:].column("length").to_numpy()
    checked = len(stored["train"]["files"]) + len(stored["eval"]["files"]) + len(stored["inputs"]) + 1
    how = (
        f"opened the stored build {manifest.manifest_path(cache_dir, key)} (built {stored['built']}): checked "
        f"{checked} files' sizes and modification times"
        + (f" and re-hashed {manifest.SAMPLED_SEQUENCES} sampled sequences" if resample else "")
        + f" in {time.perf_counter() - started:.2f} s"
    )
    return PretrainData(
        train,
        evaluation,
        tokenizer,
        lengths,
        stored["source"],
        Skipped(**stored["skipped"]),
        DataFingerprint(stored["vocabulary"], stored["samples"], where),
        eval_lengths,
        how,
    )


# --- the build ------------------------------------------------------------------------------------------------
def _tokenizer(data_cfg, documents, cache_dir: str, crew: Crew, work: Work, num_proc: int):
    """The configured tokenizer, or the default one trained on the corpus (word counts over the crew's processes and
    nodes, the vocabulary trained by its leader); returns it and where the stored build finds it."""
    if data_cfg.tokenizer:
        return load_tokenizer(data_cfg.tokenizer), _location(data_cfg.tokenizer)
    out_dir = trained_dir(data_cfg, documents, cache_dir)
    trained = os.path.join(out_dir, "tokenizer.json")
    if crew.agree("tokenizer", lambda: "load" if os.path.exists(trained) else "train") == "train":
        counts = count_words_parallel(documents, num_proc, share=crew.share(), progress=work)
        if not crew.solo:  # each node counted its parts; the leader adds them up
            folder = f"{out_dir}.counts"
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"node{crew.node}.pkl.tmp"), "wb") as fh:
                pickle.dump(counts, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(os.path.join(folder, f"node{crew.node}.pkl.tmp"), os.path.join(folder, f"node{crew.node}.pkl"))
            crew.wait_others("word-counts")
            if crew.is_leader:
                counts = Counter()
                for node in crew.nodes:
                    with open(os.path.join(folder, f"node{node}.pkl"), "rb") as fh:
                        counts.update(pickle.load(fh))
        if crew.is_leader:
            work.stage("training the vocabulary")
            save_wordpiece(counts, data_cfg.tokenizer_vocab_size, out_dir)
        crew.agree("tokenizer-trained", lambda: "yes")
    return load_tokenizer(out_dir), os.path.relpath(out_dir, cache_dir)


def _build(cfg, cache_dir: str, key: str, settings: dict, crew: Crew, work: Work) -> None:
    """Build the sequences of ``cfg`` (this node's share of them, in a crew) and, on the crew's leader, the stored
    fingerprint."""
    data_cfg, model_cfg = cfg.data, cfg.model
    started = time.perf_counter()
    inputs = corpus_inputs(data_cfg, cache_dir)  # before reading: a file changed meanwhile is found at restart
    skipped = Skipped("records")
    work.stage("reading the corpus")
    documents = load_documents(data_cfg, cache_dir, skipped)
    num_proc = data_cfg.num_proc or default_num_proc(text_bytes(documents), available_cores())
    views = [json.loads(v) for v in crew.gather("documents", json.dumps([documents._fingerprint, num_proc]))]
    other = next((n for n, v in zip(crew.nodes, views) if v[0] != views[0][0]), None)
    if other is not None:
        raise DataError(
            f"nodes {crew.nodes[0]} and {other} read other documents for one data.cache_dir {cache_dir} (datasets "
            f"fingerprints {views[0][0]} vs {views[crew.nodes.index(other)][0]}): give every node the same corpus files"
        )
    crew.procs = tuple(v[1] for v in views)
    tokenizer, tokenizer_location = _tokenizer(data_cfg, documents, cache_dir, crew, work, num_proc)
    train_docs, eval_docs = split_documents(documents, data_cfg.eval_fraction, data_cfg.seed)
    common = dict(
        max_seq_length=data_cfg.max_seq_length,
        short_seq_prob=data_cfg.short_seq_prob,
        nsp=model_cfg.objective == "mlm_nsp",
        seed=data_cfg.seed,
        cache_dir=cache_dir,
        num_proc=num_proc,
        share=crew.share(),
        progress=work,
    )
    train = build_sequences(train_docs, tokenizer, split="train", **common)
    evaluation = build_sequences(eval_docs, tokenizer, split="eval", **common)
    source = _describe_source(data_cfg)
    if len(train) == 0:
        raise DataError(f"corpus {source} produced no training sequences")
    if len(evaluation) > data_cfg.max_eval_samples:
        evaluation = evaluation.select(range(data_cfg.max_eval_samples))
    if crew.is_leader:
        work.stage("fingerprinting the sequences")
        extra = {"source": source, "skipped": asdict(skipped), "nodes": list(crew.nodes), "num_proc": list(crew.procs)}
        extra["stage_seconds"] = {name: round(seconds, 2) for name, seconds in work.durations.items()}
        manifest.record(
            cache_dir, key, settings=settings, inputs=inputs, tokenizer=tokenizer_location, tokenizer_obj=tokenizer,
            train=train, evaluation=evaluation, extra=extra, started=started,
        )  # fmt: skip


def _node_data(cfg, cache_dir: str, crew: Crew, work: Work, say=print0) -> PretrainData:
    """This node's data: the stored build opened when it is current, else built (by the crew) and then opened."""
    key, settings = settings_key(cfg)
    lock = FileLock(os.path.join(cache_dir, ".build.lock")) if crew.is_leader else nullcontext()
    opened: list[PretrainData] = []

    def decide() -> str:
        try:
            opened.append(_open_stored(cfg, cache_dir, key, resample=True))
            return ""
        except manifest.Stale as stale:
            for path in stale.damaged:  # a rebuild would reuse these parts (found by name)
                if os.path.exists(path):
                    os.unlink(path)
            return str(stale)

    if crew.is_leader:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            work.stage(f"waiting for another process's build of data.cache_dir {cache_dir} (its lock)")
            say(f"data: another process is building data.cache_dir {cache_dir}; waiting for its lock")
            lock.acquire()
    try:
        reason = crew.agree("decision", decide)
        if not reason:
            data = opened[0] if opened else _open_stored(cfg, cache_dir, key, resample=False)
        else:
            say(f"data: building {_describe_source(cfg.data)} into data.cache_dir {cache_dir}: {reason}")
            started = time.perf_counter()
            try:
                _build(cfg, cache_dir, key, settings, crew, work)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise DataError(
                    f"no space left on the device of data.cache_dir {cache_dir} while building the data "
                    f"({exc.filename or exc.strerror}): free space there or give data.cache_dir on a larger disk"
                ) from None
            crew.agree("built", lambda: "yes")
            data = _open_stored(cfg, cache_dir, key, resample=False)
            data.opened = f"built in {time.perf_counter() - started:.1f} s; {data.opened}"
    finally:
        if crew.is_leader:
            lock.release()
    return data


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


def build_pretrain_data(cfg, topo=None) -> PretrainData:
    """Open the stored build of this corpus and these settings, or build it (see the module docstring). ``cfg``: a
    :class:`~ds_bertopt.config.BertOptConfig`. Without ``topo`` (or alone in the job): this process, under the
    cache's build lock, with a progress line every 30 s. In a job, collective: every rank returns once every node
    has its data."""
    cache_dir = os.path.abspath(os.path.expanduser(cfg.data.cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    store = job_store() if topo is not None and topo.world_size > 1 else None
    if store is None:
        with Work(None, "data", "data build", say=print0) as work:
            return _node_data(cfg, cache_dir, Crew(), work)
    stale_s = cfg.train.dist_timeout_s
    labels = work_labels(topo.num_nodes)
    mine = work_name(topo.node_rank)
    if topo.local_rank == 0:
        with Work(store, mine, labels[mine]) as work:
            nodes = (topo.node_rank,)
            if topo.num_nodes > 1:
                work.stage("looking for the nodes that share data.cache_dir")
                nodes = sharing_nodes(store, topo.node_rank, topo.num_nodes, cache_dir, stale_s, say=print_all)
                print_all(describe_storage(cache_dir, topo.node_rank, nodes))
            crew = Crew(nodes, topo.node_rank, store, stale_s, say=print_all)
            data = _node_data(cfg, cache_dir, crew, work, say=print_all if topo.num_nodes > 1 else print0)
            work.finish()
    else:
        wait_for(store, [mine], labels, stale_s=stale_s, say=print_all if topo.local_rank == 1 else None)
        data = _open_stored(cfg, cache_dir, settings_key(cfg)[0], resample=False)
    # no rank starts the collectives that follow (the ranks compare the data's digests) before every node has its data
    wait_for(store, list(labels), labels, stale_s=stale_s, say=print_all if topo.rank == 0 else None)
    return data
