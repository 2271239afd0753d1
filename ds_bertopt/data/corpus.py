"""Where pretraining text comes from: the embedded corpus, the user's files, or a ``datasets`` dataset.

The **embedded corpus** needs no download and is real human-written English: the docstrings of the
running interpreter's standard library, read with :mod:`ast` (nothing is imported), one document per
module. It is extracted once into ``cache_dir`` as jsonl.

**User files** (``data.train_files``, globs allowed): ``.txt`` (a document per blank-line-separated
block, or per line), ``.jsonl``/``.json`` (one object per line with ``text_field``), each optionally
``.gz``. Every file is checked before anything is built — exists, is a file, is not empty, can be
read, starts with valid UTF-8 — and a problem is one line naming the file.

Everything ends as a ``datasets.Dataset`` with a single ``text`` column (one row per document), so
the later ``map`` steps are cached by ``datasets``.
"""

from __future__ import annotations

import ast
import glob
import gzip
import hashlib
import json
import os
import sys
import sysconfig
from collections import Counter
from typing import Iterator, Optional

from ..errors import DataError
from ..mounts import existing_parent
from .skipped import NAMED, Skipped

TEXT_SUFFIXES = (".txt", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_UTF8_PROBE_BYTES = 1 << 20


def _strip_gz(path: str) -> str:
    return path[:-3] if path.endswith(".gz") else path


def file_kind(path: str) -> str:
    """``"text"`` or ``"json"`` from the file name (``.gz`` allowed); anything else is an error."""
    base = _strip_gz(path).lower()
    if base.endswith(TEXT_SUFFIXES):
        return "text"
    if base.endswith(JSON_SUFFIXES):
        return "json"
    raise DataError(f"corpus file {path}: unsupported extension; use .txt, .jsonl or .json (optionally .gz)")


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def check_cache_dir(path: str, key: str) -> None:
    """A directory that exists or can be created (and written), or one line naming ``key``."""
    path = os.path.expanduser(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"{key}: {path} is not a directory")
    existing = existing_parent(path)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK, effective_ids=True):
        raise DataError(f"{key}: cannot create or write {path} ({existing} is not a writable directory)")


def check_dataset_dir(path: str) -> None:
    """``data.dataset`` given as a path: a directory (``datasets.save_to_disk``), or one line naming it."""
    if not os.path.exists(os.path.expanduser(path)):
        raise DataError(f"data.dataset: {path} does not exist")
    if not os.path.isdir(os.path.expanduser(path)):
        raise DataError(f"data.dataset: {path} is a file; give a directory saved by datasets.save_to_disk")


def check_corpus_file(path: str) -> None:
    """Fail with one line if ``path`` cannot serve as a corpus file."""
    if not os.path.exists(path):
        raise DataError(f"corpus file {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"corpus file {path} is not a regular file")
    if os.path.getsize(path) == 0:
        raise DataError(f"corpus file {path} is empty")
    if not os.access(path, os.R_OK, effective_ids=True):
        raise DataError(f"corpus file {path} is not readable (permission denied)")
    file_kind(path)
    try:
        with _open_bytes(path) as fh:
            head = fh.read(_UTF8_PROBE_BYTES)
    except (OSError, EOFError) as exc:
        raise DataError(f"corpus file {path} cannot be read: {exc}") from None
    if not head.strip():
        raise DataError(f"corpus file {path} holds only white space")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # a cut multi-byte character at the probe's end is fine
            raise DataError(f"corpus file {path} is not UTF-8 text (invalid byte at offset {exc.start})") from None


def check_json_field(path: str, field: str) -> None:
    """The first non-empty line of a jsonl file must be an object with ``field``."""
    with _open_bytes(path) as fh:
        for number, raw in enumerate(fh, 1):  # noqa: B007 - number names the line after the loop
            if raw.strip():
                break
        else:
            return
    try:
        first = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"corpus file {path} line {number} is not JSON (expected one object per line)") from None
    if not isinstance(first, dict):
        raise DataError(f"corpus file {path} line {number} is not a JSON object")
    if field not in first:
        raise DataError(
            f"corpus file {path} line {number} has no field {field!r} "
            f"(fields: {', '.join(first) or 'none'}); set data.text_field"
        )


def expand_patterns(patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Expand globs (sorted, deduplicated), without reading the files."""
    files: list[str] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
        if not matches:
            raise DataError(f"corpus pattern {pattern} matches no files")
        for match in matches:
            if match not in files:
                files.append(match)
    return files


def expand_train_files(patterns: tuple[str, ...] | list[str], text_field: str | None = None) -> list[str]:
    """Expand globs (sorted, deduplicated) and check every file (and, for jsonl, ``text_field``)."""
    files = expand_patterns(patterns)
    for path in files:
        check_corpus_file(path)
        if text_field is not None and file_kind(path) == "json":
            check_json_field(path, text_field)
    return files


def stdlib_docstring_documents() -> Iterator[dict]:
    """One document per stdlib module: its module, class and function docstrings, in source order."""
    root = sysconfig.get_paths()["stdlib"]
    skip_dirs = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            parts = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc.split()) >= 4:
                        parts.append(doc.strip())
            if parts:
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                yield {"title": module, "text": "\n\n".join(parts)}


def embedded_corpus_path(cache_dir: str) -> str:
    """Extract the embedded corpus once (atomically) and return the jsonl path."""
    version = ".".join(map(str, sys.version_info[:3]))
    tag = hashlib.sha1(sysconfig.get_paths()["stdlib"].encode()).hexdigest()[:8]
    path = os.path.join(cache_dir, "corpus", f"stdlib-docstrings-py{version}-{tag}.jsonl")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    count = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for doc in stdlib_docstring_documents():
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        os.unlink(tmp)
        raise DataError(f"no docstrings found under {sysconfig.get_paths()['stdlib']} for the embedded corpus")
    try:
        os.link(tmp, path)  # never replaces: another node sharing the cache may have recorded the first one's mtime
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path


def load_documents(data_cfg, cache_dir: str, skipped: Optional[Skipped] = None):
    """A ``datasets.Dataset`` with one ``text`` row per document (a ``data.dataset`` that already holds ``input_ids``:
    one ``input_ids`` row per document, tokenization skipped).

    Records of jsonl files and datasets without usable text (no text field, text that is not a string, empty
    text) are skipped and tallied in ``skipped`` (a :class:`~ds_bertopt.data.skipped.Skipped`), which refuses
    the corpus past ``data.max_skipped_fraction``; blank lines and blocks of ``.txt`` files are layout, not
    records, and are dropped without a count."""
    import datasets

    skipped = skipped if skipped is not None else Skipped()
    hf_cache = os.path.join(cache_dir, "hf_datasets")
    files: list[str] = []
    if data_cfg.dataset:
        ds = _load_named_dataset(data_cfg, hf_cache)
        source = data_cfg.dataset
    else:
        files = (
            expand_train_files(data_cfg.train_files, data_cfg.text_field)
            if data_cfg.train_files
            else [embedded_corpus_path(cache_dir)]
        )
        source = ", ".join(files)
        kinds = {file_kind(f) for f in files}
        if len(kinds) > 1:
            raise DataError(f"corpus files mix .txt and .jsonl ({source}); use one kind per run")
        kind = kinds.pop()
        try:
            if kind == "text":
                sample_by = "paragraph" if data_cfg.txt_format == "paragraph" else "line"
                ds = datasets.load_dataset(
                    "text", data_files=files, sample_by=sample_by, split="train", cache_dir=hf_cache
                )
            else:
                ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=hf_cache)
        except Exception as exc:  # datasets wraps parse errors in several types; name the file
            raise DataError(f"corpus {source} cannot be parsed: {str(exc).splitlines()[0][:300]}") from None
    if data_cfg.dataset and "input_ids" in ds.column_names:  # already tokenized: the text is not needed
        return _pretokenized(ds.select_columns(["input_ids"]), data_cfg, source)
    text_files = bool(files) and file_kind(files[0]) == "text"
    field = "text" if text_files or not (data_cfg.train_files or data_cfg.dataset) else data_cfg.text_field
    if field not in ds.column_names:
        raise DataError(
            f"corpus {source} has no field {field!r} (fields: {', '.join(ds.column_names)}); set data.text_field"
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    if text_files:
        ds = ds.filter(lambda batch: [bool(t.strip()) for t in batch["text"]], batched=True, desc="dropping blank text")
    else:
        ds = _skip_unusable(ds, files, field, skipped)
        skipped.check(f"corpus {source}", data_cfg.max_skipped_fraction)
    return _enough(ds, data_cfg, source)


def _enough(ds, data_cfg, source: str):
    """``data.max_documents`` applied; at least two documents (one is held out)."""
    if data_cfg.max_documents is not None:
        ds = ds.select(range(min(len(ds), data_cfg.max_documents)))
    if len(ds) < 2:
        raise DataError(
            f"corpus {source} has {len(ds)} non-empty document(s); need at least 2 (one is held out for evaluation)"
        )
    return ds


def _pretokenized(ds, data_cfg, source: str):
    """A dataset of token ids (``input_ids``, e.g. saved by a ``run_mlm``-style script): rows without ids dropped;
    tokenization is skipped (the pipeline cuts every row into sequences)."""
    ds = ds.filter(lambda batch: [bool(ids) for ids in batch["input_ids"]], batched=True, desc="dropping empty rows")
    return _enough(ds, data_cfg, source)


def _unusable(text) -> Optional[str]:
    """Why a record's text cannot be trained on, or None."""
    if text is None:
        return "no text field"
    if not isinstance(text, str):
        return "text not a string"
    return None if text.strip() else "empty text"


def _skip_unusable(ds, files: list[str], field: str, skipped: Skipped):
    """``ds`` without its unusable records, each tallied in ``skipped`` by reason and place."""
    bad: dict[int, str] = {}
    batch_size = 10_000
    for start in range(0, len(ds), batch_size):
        for offset, text in enumerate(ds[start : start + batch_size]["text"]):
            reason = _unusable(text)
            if reason:
                bad[start + offset] = reason
    skipped.total += len(ds)
    if not bad:
        return ds
    shown, per_reason = set(), Counter()
    for index, reason in bad.items():  # the first few of each reason are named
        if per_reason[reason] < NAMED:
            shown.add(index)
            per_reason[reason] += 1
    places = _json_places(files, shown) if files else {i: f"row {i}" for i in shown}
    for index, reason in bad.items():
        skipped.add(reason, places.get(index, f"record {index + 1}"))
    return ds.select([i for i in range(len(ds)) if i not in bad])


def _json_places(files: list[str], indices: set[int]) -> dict[int, str]:
    """Record index (over all files, blank lines skipped as the json reader skips them) → ``"line N"`` (with the
    file's name when there are several); reads only as far as the last index asked for."""
    places: dict[int, str] = {}
    record = 0
    for path in files:
        with _open_bytes(path) as fh:
            for number, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                if record in indices:
                    places[record] = f"line {number}" if len(files) == 1 else f"{os.path.basename(path)} line {number}"
                    if len(places) == len(indices):
                        return places
                record += 1
    return places


def _load_named_dataset(data_cfg, hf_cache: str):
    import datasets

    name = os.path.expanduser(data_cfg.dataset)
    try:
        if os.path.isdir(name):
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if data_cfg.dataset_split not in ds:
                    raise DataError(f"dataset {name} has no split {data_cfg.dataset_split!r} (splits: {', '.join(ds)})")
                ds = ds[data_cfg.dataset_split]
            return ds
        return datasets.load_dataset(name, split=data_cfg.dataset_split, cache_dir=hf_cache)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"dataset {data_cfg.dataset} cannot be loaded: {str(exc).splitlines()[0][:300]}") from None
