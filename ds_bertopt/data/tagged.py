"""Tagged words for token classification (NER): CoNLL-style files, ``.jsonl`` or a ``datasets`` directory.

* CoNLL (``.conll``, ``.txt``, ``.tsv``, ``.iob``, ``.bio``): one word a line, its tag in the last column (columns
  separated by a tab, or by spaces when the line has no tab), a blank line between sentences; ``-DOCSTART-``
  lines are skipped. A line with one column, or a tag that is not ``O`` or ``B-``/``I-``/``E-``/``S-`` + type, is a
  one-line :class:`~ds_bertopt.errors.DataError` naming the file and the line.
* ``.jsonl`` / ``datasets``: a list of words (``tokens_column``) and a list of tags (``tags_column``) per record;
  tags are strings, or ids named by ``label_names`` or by the dataset's ``ClassLabel`` feature.

Sub-words: :func:`align_word_labels` gives each word's tag id to its first sub-word and ``-100`` (ignored by the
loss) to the rest and to special tokens, as transformers' ``run_ner`` does with ``label_all_tokens`` off;
:func:`word_predictions` reads the predictions back per word (``O`` for a word cut off by truncation).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..errors import DataError
from ..labels import IGNORE_INDEX
from .labelled import _read_text, check_columns, load_dataset_dir, read_records, subset_indices
from .skipped import Skipped

CONLL_SUFFIXES = (".conll", ".txt", ".tsv", ".iob", ".bio")
TAG = re.compile(r"^(O|[BIES]-\S.*)$")
"""A tag seqeval reads: ``O`` or a ``B-``/``I-`` (IOBES: also ``E-``/``S-``) prefix and a type."""


@dataclass(frozen=True)
class TaggedData:
    words: tuple[tuple[str, ...], ...]
    """Each sentence's words."""
    tags: tuple[tuple[str, ...], ...]
    """Each word's tag (``O``, ``B-person``, …)."""
    source: str
    """Where they came from (for log lines)."""
    skipped: str = ""
    """Sentences skipped (no words), as the data line says it."""

    def __len__(self) -> int:
        return len(self.words)

    def subset(self, limit: Optional[int], seed: int, shuffle: bool) -> "TaggedData":
        picks = subset_indices(len(self), limit, seed, shuffle)
        if picks is None:
            return self
        return TaggedData(
            tuple(self.words[i] for i in picks),
            tuple(self.tags[i] for i in picks),
            f"{self.source} ({limit} of {len(self)})",
            self.skipped,
        )


def _check_tag(tag: str, where: str) -> str:
    if not TAG.match(tag):
        raise DataError(
            f"{where}: tag {tag!r} is not O or B-/I-<type> (BIO/IOB2; IOBES's E-/S- are read too); is the tag the "
            "line's last column?"
        )
    return tag


def _conll_sentences(path: str) -> Iterator[tuple[str, list[str], list[str]]]:
    words: list[str] = []
    tags: list[str] = []
    first = 0
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip() or line.startswith("-DOCSTART-"):
            if words:
                yield f"line {first}", words, tags
            words, tags = [], []
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        parts = [p for p in (p.strip() for p in parts) if p] if "\t" in line else parts
        if len(parts) < 2:
            raise DataError(
                f"{path} line {number}: expected 'word<TAB>tag' (a blank line between sentences), got {line.strip()!r}"
            )
        if not words:
            first = number
        words.append(parts[0])
        tags.append(_check_tag(parts[-1], f"{path} line {number}"))
    if words:
        yield f"line {first}", words, tags


def _tag_names_of(data, column: str) -> tuple[str, ...]:
    """The names of a ``datasets`` ``Sequence(ClassLabel)`` tag column, or ``()``."""
    feature = getattr(getattr(data, "features", {}).get(column), "feature", None)
    return tuple(getattr(feature, "names", ()) or ())


def _as_tags(value, where: str, column: str, names: Sequence[str], count: int) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}: {column} must be a list of tags, got {type(value).__name__}")
    if len(value) != count:
        raise DataError(f"{where}: {count} words but {len(value)} {column}")
    tags = []
    for tag in value:
        if isinstance(tag, int) and not isinstance(tag, bool):
            if not names:
                raise DataError(
                    f"{where}: {column} holds tag ids ({tag}); name the tags in id order with finetune.label_names"
                )
            if not 0 <= tag < len(names):
                raise DataError(f"{where}: tag id {tag} is outside the {len(names)} label_names")
            tag = names[tag]
        elif not isinstance(tag, str):
            raise DataError(f"{where}: {column} holds a {type(tag).__name__}, not a tag")
        tags.append(_check_tag(tag, where))
    return tags


def load_tagged(
    path: str,
    tokens_column: str = "tokens",
    tags_column: str = "ner_tags",
    split: Optional[str] = None,
    label_names: Sequence[str] = (),
    max_skipped_fraction: float = 0.01,
) -> TaggedData:
    """Read tagged sentences from ``path`` (see the module docstring)."""
    skipped = Skipped("sentences")
    sentences: list[tuple[list[str], list[str]]] = []
    if path and os.path.isfile(path) and path.lower().endswith(CONLL_SUFFIXES):
        if os.path.getsize(path) == 0:
            raise DataError(f"{path} is empty")
        for _, words, tags in _conll_sentences(path):
            skipped.total += 1
            sentences.append((words, tags))
    else:
        columns, rows = read_records(path, split, (".jsonl", *CONLL_SUFFIXES))
        names = tuple(label_names)
        if columns is not None:
            check_columns(path, list(columns), (tokens_column, tags_column))
            names = names or _tag_names_of(load_dataset_dir(path, split), tags_column)
        for place, record in rows:
            where = f"{path} {place}"
            skipped.total += 1
            check_columns(where, list(record), (tokens_column, tags_column))
            words = record[tokens_column]
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise DataError(f"{where}: {tokens_column} must be a list of words (strings)")
            if not words:
                skipped.add("no words", place)
                continue
            sentences.append((list(words), _as_tags(record[tags_column], where, tags_column, names, len(words))))
    skipped.check(path, max_skipped_fraction)
    if not sentences:
        raise DataError(f"{path} has no sentences")
    return TaggedData(
        tuple(tuple(w) for w, _ in sentences), tuple(tuple(t) for _, t in sentences), path, skipped.line()
    )


def tag_set(train: TaggedData, validation: Optional[TaggedData], label_names: Sequence[str]) -> tuple[str, ...]:
    """The model's tags in id order: ``label_names`` when given (every tag of the data must be one of them), else
    ``O`` and then the tags of the training and validation data, sorted."""
    found = {tag for data in filter(None, (train, validation)) for sentence in data.tags for tag in sentence}
    if label_names:
        unknown = sorted(found - set(label_names))
        if unknown:
            raise DataError(f"finetune.label_names: the data has tag {unknown[0]!r}, not one of {list(label_names)}")
        return tuple(label_names)
    return ("O",) + tuple(sorted(found - {"O"}))


def align_word_labels(word_ids: Sequence[Optional[int]], word_labels: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(labels per token, the word of each labelled token)``: a word's label at its first sub-word, ``-100`` at its
    other sub-words and at special tokens (``word_ids`` as a fast tokenizer's ``word_ids()`` gives them)."""
    labels, words, previous = [], [], None
    for word in word_ids:
        first = word is not None and word != previous
        labels.append(word_labels[word] if first else IGNORE_INDEX)
        if first:
            words.append(word)
        previous = word
    return labels, words


def word_predictions(label_words: Sequence[int], predicted: Sequence[int], num_words: int, names: Sequence[str]):
    """Every word's predicted tag from the predictions at the labelled tokens (``label_words``: their words, as
    :func:`align_word_labels` gives them); a word without a token (cut off by ``max_seq_length``, or one the
    tokenizer drops) is ``O``."""
    tags = ["O"] * num_words
    for word, p in zip(label_words, predicted, strict=True):
        tags[word] = names[p]
    return tags
