"""The stored fingerprint: what a build made, recorded beside the cache once, so that a restart opens it in seconds.

A build writes ``<cache_dir>/built/<key>/manifest.json`` last (atomically), ``<key>`` a digest of the settings
that decide the sequences. It records:

* the inputs: every corpus file (or the extracted embedded corpus, or a ``datasets`` directory's files) with its
  size and modification time;
* the outputs: the Arrow files of the training and held-out sequences, in order, with their sizes and modification
  times, and their row counts;
* the digests: the vocabulary's, the samples' (every token, hashed once, here, chunk by chunk without a copy:
  :func:`~.identity.table_digest`) and a sampled one (:data:`SAMPLED_SEQUENCES` sequences spread over the set);
* the training lengths, as one Arrow column in ``lengths.arrow`` (one record batch: read zero-copy into numpy,
  memory-mapped, shared by the ranks of a node through the page cache).

A restart (:func:`verify`) stats the inputs and outputs, re-hashes the sampled sequences and compares the
vocabulary: milliseconds, with no Python per row, whatever the corpus size. Any difference is named in one line
and the cache is rebuilt. The ranks then compare the stored digests (:func:`~.identity.check_same_data`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np

from .identity import sampled_digest, table_digest, vocabulary_digest

MANIFEST_VERSION = "1"
BUILT_DIR = "built"
SAMPLED_SEQUENCES = 4096
"""Sequences re-hashed at every restart (spread evenly over the set)."""
SAMPLE_COLUMNS = ("input_ids", "token_type_ids", "next_sentence_label")
"""What the samples' digest covers (``length`` follows from ``input_ids``)."""


class Stale(Exception):
    """The stored build does not match (its one-line reason)."""

    def __init__(self, reason: str, damaged: tuple[str, ...] = ()):
        super().__init__(reason)
        self.damaged = damaged
        """Cache files that no longer hold what was built (removed before the rebuild, which would reuse them)."""


def manifest_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, BUILT_DIR, key, "manifest.json")


def file_stats(paths: list[str], root: Optional[str] = None) -> list[dict]:
    """``{"path", "size", "mtime_ns"}`` of each file (``path`` relative to ``root`` when given)."""
    out = []
    for path in paths:
        st = os.stat(path if root is None else os.path.join(root, path))
        out.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def first_change(recorded: list[dict], current: list[dict], what: str) -> Optional[str]:
    """One line naming the first difference between two :func:`file_stats` lists, or None."""
    before, now = {r["path"]: r for r in recorded}, {c["path"]: c for c in current}
    for path in now:
        if path not in before:
            return f"{what} {path} is new since the cache was built"
    for path, old in before.items():
        new = now.get(path)
        if new is None:
            return f"{what} {path} is gone since the cache was built"
        if new["size"] != old["size"]:
            return f"{what} {path} changed since the cache was built (size {old['size']:,} → {new['size']:,} bytes)"
        if new["mtime_ns"] != old["mtime_ns"]:
            then, later = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(x / 1e9)) for x in (old["mtime_ns"], new["mtime_ns"])
            )
            return f"{what} {path} changed since the cache was built (modified {then} → {later})"
    if list(before) != list(now):
        return f"{what}s are in another order than when the cache was built"
    return None


def write_lengths(path: str, table) -> None:
    """The ``length`` column of ``table`` as one Arrow record batch (int16 when it fits, else int32)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.column("length")
    lengths = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], pa.int64())
    narrow = pa.int16() if len(lengths) == 0 or pc.max(lengths).as_py() < 2**15 else pa.int32()
    batch = pa.record_batch([lengths.cast(narrow)], names=["length"])
    tmp = f"{path}.tmp{os.getpid()}"
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)


def read_lengths(path: str) -> np.ndarray:
    """The lengths written by :func:`write_lengths`: a read-only numpy view of the memory-mapped file (no copy)."""
    import pyarrow as pa

    batch = pa.ipc.open_file(pa.memory_map(path, "r")).get_batch(0)
    return batch.column(0).to_numpy(zero_copy_only=True)


def open_sequences(cache_dir: str, files: list[dict], rows: int):
    """The ``datasets.Dataset`` assembled from its Arrow files, in order (memory-mapped)."""
    import datasets

    parts = [datasets.Dataset.from_file(os.path.join(cache_dir, f["path"])) for f in files]
    dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return dataset.select(range(rows)) if rows < len(dataset) else dataset


def record(
    cache_dir: str, key: str, *, settings: dict, inputs: list[dict], tokenizer: str, tokenizer_obj, train, evaluation,
    extra: dict, started: float,
) -> dict:  # fmt: skip
    """Fingerprint the build (hashing every sample once) and write the manifest and the lengths; returns it.
    ``started``: when the build started (``time.perf_counter``), for the record."""
    folder = os.path.dirname(manifest_path(cache_dir, key))
    os.makedirs(folder, exist_ok=True)
    write_lengths(os.path.join(folder, "lengths.arrow"), train.with_format("arrow")[:])
    sets = {}
    for name, dataset in (("train", train), ("eval", evaluation)):
        files = [os.path.relpath(f["filename"], cache_dir) for f in dataset.cache_files]
        sets[name] = {
            "files": file_stats(files, cache_dir),
            "rows": len(dataset),
            "digest": table_digest(dataset.with_format("arrow")[:], SAMPLE_COLUMNS),
            "sampled": sampled_digest(dataset, SAMPLE_COLUMNS, SAMPLED_SEQUENCES),
        }
    manifest = {
        "version": MANIFEST_VERSION,
        "key": key,
        "settings": settings,
        "inputs": inputs,
        "tokenizer": tokenizer,
        "vocabulary": vocabulary_digest(tokenizer_obj),
        "samples": f"{sets['train']['digest']}-{sets['eval']['digest']}",
        **sets,
        "lengths": file_stats([os.path.relpath(os.path.join(folder, "lengths.arrow"), cache_dir)], cache_dir)[0],
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        **extra,
        "build_seconds": round(time.perf_counter() - started, 1),  # the fingerprinting included
    }
    path = manifest_path(cache_dir, key)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, path)
    return manifest


def read(cache_dir: str, key: str) -> dict:
    """The manifest of ``key``; :class:`Stale` when there is none (or it is unreadable, or of another version)."""
    path = manifest_path(cache_dir, key)
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise Stale("no cache was built for this corpus and these settings yet") from None
    except (OSError, ValueError) as exc:
        raise Stale(f"its stored fingerprint {path} cannot be read ({exc})") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise Stale(f"its stored fingerprint {path} is of another version")
    return manifest


def verify(manifest: dict, cache_dir: str, inputs: list[dict], resample: bool = True):
    """Open a stored build, checking it cheaply: the inputs' and outputs' sizes and modification times, and (with
    ``resample``) the sampled digests. Returns ``(train, eval, lengths)``; :class:`Stale` names the first
    difference."""
    change = first_change(manifest["inputs"], inputs, "corpus file")
    if change:
        raise Stale(change)
    outputs = [*manifest["train"]["files"], *manifest["eval"]["files"], manifest["lengths"]]
    damaged = tuple(os.path.join(cache_dir, f["path"]) for f in outputs)
    try:
        change = first_change(outputs, file_stats([f["path"] for f in outputs], cache_dir), "cache file")
    except FileNotFoundError as exc:
        raise Stale(f"cache file {exc.filename} is gone since the cache was built", damaged) from None
    if change:
        raise Stale(change, damaged)
    opened = []
    for name in ("train", "eval"):
        entry = manifest[name]
        dataset = open_sequences(cache_dir, entry["files"], entry["rows"])
        if resample and sampled_digest(dataset, SAMPLE_COLUMNS, SAMPLED_SEQUENCES) != entry["sampled"]:
            raise Stale(
                f"the {name} sequences in data.cache_dir no longer match their stored fingerprint ({SAMPLED_SEQUENCES} "
                "sampled sequences re-hashed differ): a cache file was changed in place",
                damaged,
            )
        opened.append(dataset)
    lengths = read_lengths(os.path.join(cache_dir, manifest["lengths"]["path"]))
    if len(lengths) != len(opened[0]):
        raise Stale(f"{manifest['lengths']['path']} holds {len(lengths)} lengths for {len(opened[0])} sequences")
    return opened[0], opened[1], lengths
