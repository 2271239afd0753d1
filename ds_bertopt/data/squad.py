"""Extractive question answering: SQuAD-style data, windows over long contexts, and the answer read back.

Files: JSON lines (one ``{"question", "context", "answers": {"text": [...], "answer_start": [...]}}`` a line, as
``datasets`` writes SQuAD), SQuAD's own nested ``.json`` (``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}``),
or a ``datasets`` directory. Empty answer lists mark an unanswerable question (SQuAD v2). An answer whose text is not
at its ``answer_start`` in the context is a one-line :class:`~ds_bertopt.errors.DataError` naming the file, the line,
the answer and what the context holds there.

Windows (:func:`qa_windows`): ``[CLS] question [SEP] context [SEP]`` of at most ``max_length`` tokens; a longer
context continues in further windows that overlap the previous one by ``stride`` tokens (the fast tokenizer's
overflow, as transformers' ``run_qa`` builds them). A window's training target is the answer's first and last token,
or ``[CLS]`` (position 0) when the question is unanswerable or the answer is not wholly inside the window.

Reading the answer back (:func:`best_answer`, pure): over every window of a question, the span ``i <= j`` of
context tokens, at most ``max_answer_length`` long, with the largest ``start[i] + end[j]`` (all such spans, not only
the top-n starts and ends ``run_qa`` looks at); with unanswerable questions in play, no answer when the smallest
``[CLS]`` score over the windows beats it by more than ``null_threshold`` (SQuAD v2's ``null_score_diff_threshold``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from .labelled import _read_text, check_columns, read_records, subset_indices
from .skipped import Skipped


@dataclass(frozen=True)
class QAData:
    questions: tuple[str, ...]
    contexts: tuple[str, ...]
    answers: tuple[tuple[tuple[str, int], ...], ...]
    """Per question its gold answers ``(text, start character)``; ``()``: unanswerable."""
    source: str
    skipped: str = ""

    def __len__(self) -> int:
        return len(self.questions)

    @property
    def unanswerable(self) -> int:
        return sum(not a for a in self.answers)

    def subset(self, limit: Optional[int], seed: int, shuffle: bool) -> "QAData":
        picks = subset_indices(len(self), limit, seed, shuffle)
        if picks is None:
            return self
        take = lambda values: tuple(values[i] for i in picks)  # noqa: E731
        return QAData(
            take(self.questions), take(self.contexts), take(self.answers), f"{self.source} ({limit} of {len(self)})"
        )


def _nested_squad(path: str, text: str) -> Optional[Iterator[tuple[str, dict]]]:
    """Rows of SQuAD's nested ``.json`` (``None`` when the file is JSON lines)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None

    def rows():
        for a, article in enumerate(data["data"]):
            for p, paragraph in enumerate(article.get("paragraphs", ())):
                for q, qa in enumerate(paragraph.get("qas", ())):
                    answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                    record = {
                        "question": qa.get("question"),
                        "context": paragraph.get("context"),
                        "answers": {
                            "text": [x.get("text") for x in answers],
                            "answer_start": [x.get("answer_start") for x in answers],
                        },
                    }
                    yield f"data[{a}].paragraphs[{p}].qas[{q}]", record

    return rows()


def _answers(value: Any, context: str, where: str, column: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, dict) or "text" not in value or "answer_start" not in value:
        raise DataError(f'{where}: {column} must be {{"text": [...], "answer_start": [...]}}, got {value!r:.80}')
    texts, starts = value["text"], value["answer_start"]
    if not isinstance(texts, (list, tuple)) or not isinstance(starts, (list, tuple)) or len(texts) != len(starts):
        raise DataError(f"{where}: {column}.text and {column}.answer_start must be lists of equal length")
    out = []
    for n, (text, start) in enumerate(zip(texts, starts)):
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: {column}.text[{n}] must be a non-empty string, got {text!r}")
        if isinstance(start, bool) or not isinstance(start, int):
            raise DataError(f"{where}: {column}.answer_start[{n}] must be an integer, got {start!r}")
        found = context[start : start + len(text)] if 0 <= start <= len(context) else ""
        if found != text:
            raise DataError(
                f"{where}: {column}.text[{n}] {text!r} is not at answer_start {start} of the context (it holds "
                f"{found!r} there); answer_start counts characters from 0"
            )
        out.append((text, start))
    return tuple(out)


def load_squad(
    path: str,
    question_column: str = "question",
    context_column: str = "context",
    answers_column: str = "answers",
    split: Optional[str] = None,
    max_skipped_fraction: float = 0.01,
) -> QAData:
    """Read questions, contexts and answers from ``path`` (see the module docstring)."""
    rows = None
    if path and os.path.isfile(path) and path.lower().endswith(".json") and os.path.getsize(path) > 0:
        rows = _nested_squad(path, _read_text(path))
        if rows is not None:
            question_column, context_column, answers_column = "question", "context", "answers"
    if rows is None:
        columns, rows = read_records(path, split, (".jsonl", ".json"))
        if columns is not None:
            check_columns(path, list(columns), (question_column, context_column, answers_column))
    skipped = Skipped("questions")
    questions, contexts, answers = [], [], []
    for place, record in rows:
        where = f"{path} {place}"
        skipped.total += 1
        check_columns(where, list(record), (question_column, context_column, answers_column))
        question, context = record[question_column], record[context_column]
        for column, value in ((question_column, question), (context_column, context)):
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where}: {column} must be a string, got {type(value).__name__}")
        if not (question or "").strip() or not (context or "").strip():
            skipped.add("empty question or context", place)
            continue
        answers.append(_answers(record[answers_column], context, where, answers_column))
        questions.append(question)
        contexts.append(context)
    skipped.check(path, max_skipped_fraction)
    if not questions:
        raise DataError(f"{path} has no questions")
    return QAData(tuple(questions), tuple(contexts), tuple(answers), path, skipped.line())


@dataclass(frozen=True)
class QAWindows:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    example: np.ndarray
    """The question each window belongs to."""
    start: np.ndarray
    """Training target: the answer's first token, or 0 ([CLS])."""
    end: np.ndarray
    """Training target: the answer's last token, or 0."""
    offsets: list[np.ndarray]
    """Per window ``[tokens, 2]`` character offsets into the context; ``-1`` for tokens outside the context."""


def answer_tokens(offsets: np.ndarray, start_char: int, end_char: int) -> tuple[int, int]:
    """The first and last context token of the characters ``[start_char, end_char)``, or ``(0, 0)`` when the window
    (``offsets``: ``-1`` outside the context) does not hold them whole."""
    inside = np.flatnonzero(offsets[:, 0] >= 0)
    if not len(inside) or offsets[inside[0], 0] > start_char or offsets[inside[-1], 1] < end_char:
        return 0, 0
    first = inside[offsets[inside, 0] <= start_char][-1]
    last = inside[offsets[inside, 1] >= end_char][0]
    return int(first), int(last)


def qa_windows(tokenizer, data: QAData, max_length: int, stride: int) -> QAWindows:
    """Tokenize every question with its context into overlapping windows (see the module docstring)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("finetune.task question_answering needs a fast tokenizer (offsets and overflowing windows)")
    question_lengths = [len(ids) for ids in tokenizer(list(data.questions), add_special_tokens=False)["input_ids"]]
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    longest = int(np.argmax(question_lengths))
    if question_lengths[longest] + specials + stride >= max_length:
        raise ConfigError(
            f"finetune.doc_stride: windows of max_seq_length {max_length} cannot hold the longest question "
            f"({question_lengths[longest]} tokens, question {longest} of {data.source}) and {stride} tokens of "
            "overlap; lower doc_stride or raise max_seq_length"
        )
    encoded = tokenizer(
        list(data.questions),
        list(data.contexts),
        truncation="only_second",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=True,
    )
    example = np.asarray(encoded["overflow_to_sample_mapping"], dtype=np.int64)
    offsets, starts, ends = [], [], []
    for w, pairs in enumerate(encoded["offset_mapping"]):
        sequence = encoded.sequence_ids(w)
        window = np.asarray([p if s == 1 else (-1, -1) for p, s in zip(pairs, sequence)], dtype=np.int64)
        offsets.append(window)
        gold = data.answers[example[w]]
        first, last = answer_tokens(window, gold[0][1], gold[0][1] + len(gold[0][0])) if gold else (0, 0)
        starts.append(first)
        ends.append(last)
    types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
    return QAWindows(
        encoded["input_ids"], types, example, np.asarray(starts, np.int64), np.asarray(ends, np.int64), offsets
    )


def best_span(start: np.ndarray, end: np.ndarray, offsets: np.ndarray, max_answer_length: int):
    """``(score, i, j)`` of the best span of context tokens in one window, or ``None`` when it has no context."""
    context = offsets[:, 0] >= 0
    n = len(start)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    valid = (j >= i) & (j - i < max_answer_length) & context[:, None] & context[None, :]
    if not valid.any():
        return None
    scores = np.where(valid, start[:, None] + end[None, :], -np.inf)
    flat = int(np.argmax(scores))
    return float(scores.flat[flat]), flat // n, flat % n


def best_answer(
    windows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    context: str,
    max_answer_length: int,
    allow_null: bool,
    null_threshold: float = 0.0,
) -> str:
    """The predicted answer text of one question from its windows ``(start logits, end logits, offsets)``; ``""``
    for no answer (see the module docstring)."""
    best, null = None, None
    for start, end, offsets in windows:
        null = min(null, float(start[0] + end[0])) if null is not None else float(start[0] + end[0])
        span = best_span(start, end, offsets, max_answer_length)
        if span is not None and (best is None or span[0] > best[0]):
            best = (span[0], offsets[span[1], 0], offsets[span[2], 1])
    if best is None or (allow_null and null - best[0] > null_threshold):
        return ""
    return context[best[1] : best[2]]
