"""Labelled text for sequence classification and regression: ``.csv``, ``.jsonl`` or a ``datasets`` directory.

``load_labelled(path, text_column, label_column)`` returns texts (and, with ``pair_column``, the second text of
each pair) and integer labels (``regression``: numbers), or raises
:class:`~ds_bertopt.errors.DataError` with one line naming the file and, where it applies, the line,
the column or the value: a missing or empty file, a missing text/label column, a label that is not
an integer (``"1"``, ``"1.0"`` and ``1.0`` are accepted, ``"pos"`` and ``1.5`` are not), a negative label, a
missing label, or bytes that are not UTF-8. Rows whose text is missing or empty are skipped and counted
(:class:`~ds_bertopt.data.skipped.Skipped`, in the data line), and refused past ``max_skipped_fraction``.

A directory is read with ``datasets.load_from_disk``; a ``DatasetDict`` needs ``split``. String labels are
mapped to ``0..K-1`` when ``label_names`` lists them (in class order). :func:`check_labels` then refuses label
sets that are more likely a mistake than a task: more than ``MAX_CLASSES`` classes, classes that never occur
(1-based labels), a column whose values are nearly all distinct (an id column), unless ``num_labels`` says so.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from ..errors import DataError
from .skipped import Skipped

CSV_SUFFIX = ".csv"
JSONL_SUFFIXES = (".jsonl", ".json")
FILE_SUFFIXES = (CSV_SUFFIX, *JSONL_SUFFIXES)
"""Labelled files by name; anything else is read as a ``datasets`` directory (which has splits)."""


@dataclass(frozen=True)
class LabelledData:
    texts: tuple[str, ...]
    """Input texts, in file order."""
    labels: tuple
    """Integer class labels, ``>= 0`` (regression: floats)."""
    source: str
    """Where they came from (for log lines)."""
    skipped: str = ""
    """Rows skipped for empty text, as the data line says it (``Skipped.line``); empty when none was."""
    pairs: Optional[tuple[str, ...]] = None
    """The second text of each pair (``pair_column``), or ``None`` for single texts."""

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return max(self.labels) + 1

    def subset(self, limit: Optional[int], seed: int, shuffle: bool) -> "LabelledData":
        """At most ``limit`` examples: a fixed random subset, or the first ones."""
        picks = subset_indices(len(self), limit, seed, shuffle)
        if picks is None:
            return self
        return LabelledData(
            tuple(self.texts[i] for i in picks),
            tuple(self.labels[i] for i in picks),
            f"{self.source} ({limit} of {len(self)})",
            self.skipped,
            tuple(self.pairs[i] for i in picks) if self.pairs is not None else None,
        )


def subset_indices(size: int, limit: Optional[int], seed: int, shuffle: bool) -> Optional[list[int]]:
    """The examples a ``limit`` keeps: a fixed random subset (``shuffle``) or the first ones; ``None``: all."""
    if limit is None or limit >= size:
        return None
    if not shuffle:
        return list(range(limit))
    import torch

    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:limit].tolist()


MAX_CLASSES = 100
"""Above this many classes (and without ``num_labels``) a label column is refused as a likely mistake."""


def _as_label(value: Any, where: str, column: str, names: tuple[str, ...] = ()) -> int:
    if names:
        if isinstance(value, str) and value.strip() in names:
            return names.index(value.strip())
        raise DataError(f"{where}: {column} {value!r} is not one of the label_names {list(names)}")
    if isinstance(value, bool):
        raise DataError(f"{where}: {column} {value!r} is not an integer class label")
    if isinstance(value, int):
        label = value
    elif isinstance(value, float) and value.is_integer():
        label = int(value)
    elif isinstance(value, str) and _number(value) is not None:
        number = _number(value)
        if not number.is_integer():
            raise DataError(
                f"{where}: {column} {value!r} is not an integer class label (a number with a fraction: classes "
                "are 0, 1, 2, …; a continuous target is not a classification task)"
            )
        label = int(number)
    elif isinstance(value, str):
        raise DataError(
            f"{where}: {column} {value!r} is not an integer class label; map string labels with "
            'finetune.label_names, e.g. ["negative", "positive"]'
        )
    else:
        raise DataError(f"{where}: {column} {value!r} is not an integer class label")
    if label < 0:
        raise DataError(f"{where}: {column} {label} is negative; class labels are 0, 1, 2, …")
    return label


def _as_target(value: Any, where: str, column: str) -> float:
    """A regression target: a finite number, or text that reads as one."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if math.isfinite(value) else None
    elif isinstance(value, str):
        number = _number(value)
    if number is None:
        raise DataError(f"{where}: {column} {value!r} is not a number (finetune.task regression needs numeric labels)")
    return number


def _number(text: str) -> Optional[float]:
    """A finite number written as text (``"1"``, ``"1.0"``, ``" 2 "``), or None."""
    try:
        number = float(text.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _collect(
    rows: Iterable[tuple[str, dict]],
    path: str,
    text_column: str,
    label_column: str,
    columns: Optional[Iterable[str]] = None,
    names: tuple[str, ...] = (),
    max_skipped_fraction: float = 0.01,
    pair_column: Optional[str] = None,
    regression: bool = False,
) -> LabelledData:
    """``rows`` yields ``(place, record)`` (``"line 4"``); ``columns`` (when known up front) are checked first."""
    text_columns = (text_column,) if pair_column is None else (text_column, pair_column)
    if columns is not None:
        check_columns(path, list(columns), (*text_columns, label_column))
    texts: tuple[list, ...] = tuple([] for _ in text_columns)
    labels = []
    skipped = Skipped("rows")
    for place, record in rows:
        where = f"{path} {place}"
        skipped.total += 1
        for column in (*text_columns, label_column):
            if column not in record:
                raise DataError(f"{where}: no {column!r} field (fields: {', '.join(map(str, record)) or 'none'})")
        label = record[label_column]
        if label is None or (isinstance(label, str) and not label.strip()):
            raise DataError(f"{where}: {label_column} is empty")
        values = [record[column] for column in text_columns]
        if any(text is None or (isinstance(text, str) and not text.strip()) for text in values):
            skipped.add("empty text", place)
            continue
        for column, text, kept in zip(text_columns, values, texts):
            if not isinstance(text, str):
                raise DataError(f"{where}: {column} must be a string, got {type(text).__name__}")
            kept.append(text)
        labels.append(
            _as_target(label, where, label_column) if regression else _as_label(label, where, label_column, names)
        )
    skipped.check(path, max_skipped_fraction)
    if not labels:
        raise DataError(f"{path} has no examples")
    pairs = tuple(texts[1]) if pair_column is not None else None
    return LabelledData(tuple(texts[0]), tuple(labels), path, skipped.line(), pairs)


def check_columns(path: str, columns: list, wanted: Iterable[str]) -> None:
    """One line naming the first of ``wanted`` that ``path`` lacks, and the columns it has."""
    for column in wanted:
        if column not in columns:
            raise DataError(f"{path} has no column {column!r} (columns: {', '.join(map(str, columns)) or 'none'})")


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise DataError(f"{path} cannot be read: {exc.strerror}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from None


def _csv_rows(path: str, text: str) -> tuple[list[str], Iterator[tuple[str, dict]]]:
    reader = csv.DictReader(text.splitlines(keepends=True))
    columns = list(reader.fieldnames or [])

    def rows():
        try:
            for record in reader:
                # reader.line_num counts physical lines, so quoted newlines keep line numbers right
                yield f"line {reader.line_num}", record
        except csv.Error as exc:
            raise DataError(f"{path} line {reader.line_num}: malformed CSV: {exc}") from None

    return columns, rows()


def _jsonl_rows(path: str, text: str) -> Iterator[tuple[str, dict]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number} is not valid JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
        yield f"line {number}", record


def load_labelled(
    path: str,
    text_column: str = "text",
    label_column: str = "label",
    split: Optional[str] = None,
    label_names: tuple[str, ...] = (),
    max_skipped_fraction: float = 0.01,
    pair_column: Optional[str] = None,
    regression: bool = False,
) -> LabelledData:
    """Read labelled examples from ``path`` (see the module docstring)."""
    columns, rows = read_records(path, split, (".csv", ".jsonl", ".json"))
    return _collect(
        rows,
        path,
        text_column,
        label_column,
        columns,
        tuple(label_names),
        max_skipped_fraction,
        pair_column,
        regression,
    )


def read_records(
    path: str, split: Optional[str], formats: tuple[str, ...]
) -> tuple[Optional[list], Iterator[tuple[str, dict]]]:
    """``(columns or None, rows)`` of a ``.csv``, ``.jsonl`` (``.json``: one object a line) or ``datasets`` directory,
    each row ``(place, record)``; one-line errors for a missing, empty or unreadable file."""
    if not path:
        raise DataError("no labelled data file given")
    if not os.path.exists(path):
        raise DataError(f"{path} does not exist")
    if os.path.isdir(path):
        data = load_dataset_dir(path, split)
        return data.column_names, ((f"row {i}", record) for i, record in enumerate(data))
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty")
    lower = path.lower()
    if lower.endswith(CSV_SUFFIX) and CSV_SUFFIX in formats:
        return _csv_rows(path, _read_text(path))
    if lower.endswith(JSONL_SUFFIXES):
        return None, _jsonl_rows(path, _read_text(path))
    raise DataError(f"{path}: unsupported format; use {', '.join(formats)} or a directory saved by datasets")


def load_dataset_dir(path: str, split: Optional[str]):
    """A ``datasets.Dataset`` saved with ``save_to_disk`` (``split`` chooses in a ``DatasetDict``)."""
    import datasets

    try:
        data = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"{path} is not a directory saved by datasets.save_to_disk ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if split is None or split not in data:
            raise DataError(
                f"{path} holds splits {', '.join(data)}; choose one with a split name"
                + (f" (not {split!r})" if split else "")
            )
        data = data[split]
    return data


def check_labels(
    train: LabelledData, validation: Optional[LabelledData], num_labels: Optional[int], label_column: str
) -> int:
    """The number of classes, or a one-line :class:`DataError` for a label set that looks like a mistake."""
    if num_labels is not None:
        for data in filter(None, (train, validation)):
            if data.num_labels > num_labels:
                raise DataError(
                    f"finetune.num_labels: {data.source} has label {data.num_labels - 1}, outside 0..{num_labels - 1}"
                )
        return num_labels
    classes = train.num_labels
    distinct = set(train.labels)
    given = "; if that is right, say so with finetune.num_labels"
    if classes > MAX_CLASSES:
        raise DataError(
            f"finetune.label_column: {label_column!r} of {train.source} has labels up to {classes - 1} "
            f"({len(distinct)} distinct), more than {MAX_CLASSES} classes: is it an id column{given}"
        )
    if len(distinct) > 20 and len(distinct) > 0.5 * len(train):
        raise DataError(
            f"finetune.label_column: {label_column!r} of {train.source} has {len(distinct)} distinct "
            f"values in {len(train)} examples, as an id column would{given}"
        )
    missing = sorted(set(range(classes)) - distinct)
    if missing:
        hint = " (labels look 1-based: classes are 0..K-1)" if missing == [0] else ""
        raise DataError(
            f"finetune.label_column: class {missing[0]} of 0..{classes - 1} never occurs in {train.source}{hint}{given}"
        )
    if validation is not None and validation.num_labels > classes:
        raise DataError(
            f"{validation.source} has label {validation.num_labels - 1}, but the training data has "
            f"classes 0..{classes - 1} only"
        )
    return classes
