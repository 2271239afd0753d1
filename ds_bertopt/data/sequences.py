"""BERT training sequences from tokenized documents (pure functions).

Documents are split into sentences; sentences are packed into sequences of a *target* length that
is ``max_seq_length`` most of the time and a random shorter length with probability
``short_seq_prob`` (as in BERT's ``create_pretraining_data``). Documents end where they end, so the
last sequence of a document is shorter: the corpus keeps a real length mix, which the
length-aware planner (``ds_bertopt.data.plan``) depends on. Nothing is padded here.

* ``mlm``: ``[CLS] sentences… [SEP]``; a sentence longer than the budget is cut into pieces, never
  dropped, and a sequence never mixes two documents.
* ``mlm_nsp``: ``[CLS] A [SEP] B [SEP]``; B is the true continuation or, with probability 0.5, a
  span of another document (label 1), the unused sentences being put back; over-long pairs are
  trimmed from a random end, as in BERT.
"""

from __future__ import annotations

import random
import re
from typing import Callable, Optional

import numpy as np

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Paragraphs (blank-line separated), each split after ``. ! ?`` before a capital or digit."""
    sentences = []
    for paragraph in _PARAGRAPH.split(text):
        paragraph = " ".join(paragraph.split())  # runs of white space as one space (str.split: the same as \s+)
        if paragraph:  # (stripped: no piece of the split is empty)
            sentences.extend(_SENTENCE_END.split(paragraph))
    return sentences


def special_token_count(nsp: bool) -> int:
    return 3 if nsp else 2


def _cut(sentences: list[list[int]], budget: int) -> list[list[int]]:
    """Split sentences longer than ``budget`` tokens into consecutive pieces."""
    out = []
    for sent in sentences:
        if len(sent) <= budget:  # most sentences: kept as they are (no copy)
            if sent:
                out.append(sent)
        else:
            out.extend(sent[start : start + budget] for start in range(0, len(sent), budget))
    return out


def _target_length(budget: int, short_seq_prob: float, rng: random.Random) -> int:
    return rng.randint(2, budget) if budget >= 2 and rng.random() < short_seq_prob else budget


def mlm_sequences(
    doc: list[list[int]], *, max_seq_length: int, short_seq_prob: float, rng: random.Random
) -> list[list[int]]:
    """Token lists (without special tokens) of at most ``max_seq_length - 2`` tokens each."""
    budget = max_seq_length - special_token_count(False)
    out: list[list[int]] = []
    current: list[int] = []
    target = _target_length(budget, short_seq_prob, rng)
    for sent in _cut(doc, budget):
        if current and len(current) + len(sent) > target:
            out.append(current)
            current = []
            target = _target_length(budget, short_seq_prob, rng)
        current.extend(sent)  # a new list is started after every emit, so nothing emitted is changed
        if len(current) > budget:  # a piece longer than a short target: emit what fits
            out.append(current[:budget])
            current = current[budget:]
    if current:
        out.append(current)
    return out


def _trim_pair(a: list[int], b: list[int], budget: int, rng: random.Random) -> None:
    while len(a) + len(b) > budget:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def nsp_pairs(
    doc: list[list[int]],
    *,
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
    random_document: Optional[Callable[[], list[list[int]]]],
) -> list[tuple[list[int], list[int], int]]:
    """``(tokens_a, tokens_b, label)`` with label 0 = true continuation, 1 = random segment."""
    budget = max_seq_length - special_token_count(True)
    sentences = _cut(doc, budget)
    pairs = []
    chunk: list[list[int]] = []
    length = 0
    target = _target_length(budget, short_seq_prob, rng)
    i = 0
    while i < len(sentences):
        chunk.append(sentences[i])
        length += len(sentences[i])
        if i == len(sentences) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for s in chunk[:a_end] for t in s]
            other = random_document() if random_document is not None else None
            if other and (len(chunk) == 1 or rng.random() < 0.5):
                label = 1
                target_b = max(1, target - len(tokens_a))
                start = rng.randint(0, len(other) - 1)
                tokens_b = []
                for sent in other[start:]:
                    tokens_b.extend(sent)
                    if len(tokens_b) >= target_b:
                        break
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                label = 0
                tokens_b = [t for s in chunk[a_end:] for t in s]
            if tokens_a and tokens_b:
                _trim_pair(tokens_a, tokens_b, budget, rng)
                pairs.append((tokens_a, tokens_b, label))
            elif tokens_a:  # a one-sentence document with no partner: keep it as a single segment
                pairs.append((tokens_a[:budget], [], 0))
            chunk, length = [], 0
            target = _target_length(budget, short_seq_prob, rng)
        i += 1
    return pairs


def assemble_ids(tokens_a: list[int], tokens_b: list[int], cls_id: int, sep_id: int) -> list[int]:
    """``[CLS] A [SEP] (B [SEP])``."""
    return [cls_id, *tokens_a, sep_id, *tokens_b, sep_id] if tokens_b else [cls_id, *tokens_a, sep_id]


def token_types(lengths: np.ndarray, second_lengths: np.ndarray) -> np.ndarray:
    """The token-type ids of sequences assembled by :func:`assemble_ids`, flat: 0 over ``[CLS] A [SEP]``, 1 over the
    last ``second_lengths`` tokens (``B [SEP]``; 0 without B)."""
    total = int(lengths.sum())
    first_of_b = np.repeat(np.cumsum(lengths) - second_lengths, lengths)
    return (np.arange(total) >= first_of_b).astype(np.int8)


def assemble(tokens_a: list[int], tokens_b: list[int], cls_id: int, sep_id: int) -> tuple[list[int], list[int]]:
    """``[CLS] A [SEP] (B [SEP])`` and its token-type ids."""
    ids = assemble_ids(tokens_a, tokens_b, cls_id, sep_id)
    second = len(tokens_b) + 1 if tokens_b else 0
    return ids, token_types(np.array([len(ids)]), np.array([second])).tolist()
