"""The scores fine-tuning reports, as pure functions of predictions and references (no torch, no I/O).

* :func:`accuracy`; :func:`pearson` and :func:`spearman` (ties get their average rank, as ``scipy.stats`` does)
  for regression;
* entity-level precision, recall and F1 of tag sequences with ``seqeval``'s default (conlleval) semantics:
  :func:`entities` reads the chunks of a BIO / IOB2 (also IOB1, IOBES) sequence exactly as
  ``seqeval.metrics.sequence_labeling.get_entities`` does — an ``I-X`` after ``O`` or after another type starts an
  entity, a type change ends one — and :func:`entity_scores` is its micro average (``seqeval``'s ``f1_score``,
  ``precision_score``, ``recall_score``), from counts that add up across ranks (:func:`entity_counts`);
* SQuAD v2's rules (the official ``evaluate-v2.0.py``): :func:`normalize_answer`, :func:`exact_match`,
  :func:`answer_f1` (token overlap), the maximum over the gold answers, and an unanswerable question scored
  against the empty answer (:func:`squad_scores`).
"""

from __future__ import annotations

import collections
import math
import re
import string
from typing import Iterable, Sequence

# ---------------------------------------------------------------- classification and regression


def accuracy(predictions: Sequence, references: Sequence) -> float:
    if len(predictions) != len(references):
        raise ValueError(f"accuracy: {len(predictions)} predictions for {len(references)} references")
    return sum(p == r for p, r in zip(predictions, references)) / max(len(references), 1)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r; ``nan`` when either side is constant (undefined)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"pearson: needs two sequences of equal length >= 2, got {len(x)} and {len(y)}")
    mx, my = math.fsum(x) / len(x), math.fsum(y) / len(y)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = math.fsum((a - mx) ** 2 for a in x)
    syy = math.fsum((b - my) ** 2 for b in y)
    if sxx == 0.0 or syy == 0.0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, tied values sharing their average rank (``scipy.stats.rankdata(method="average")``)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson's r of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


# ---------------------------------------------------------------- entities of tag sequences (seqeval semantics)


def _split_tag(tag: str) -> tuple[str, str]:
    """``"B-person"`` → ``("B", "person")``; ``"O"`` → ``("O", "_")`` (seqeval's prefix reading)."""
    return tag[:1], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _ends(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _starts(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The chunks ``(type, first, last)`` (inclusive word indices) of one tag sequence."""
    chunks = []
    prev_tag, prev_type, begin = "O", "", 0
    for i, tag in enumerate([*tags, "O"]):
        prefix, type_ = _split_tag(tag)
        if _ends(prev_tag, prefix, prev_type, type_):
            chunks.append((prev_type, begin, i - 1))
        if _starts(prev_tag, prefix, prev_type, type_):
            begin = i
        prev_tag, prev_type = prefix, type_
    return chunks


def entity_counts(
    references: Iterable[Sequence[str]], predictions: Iterable[Sequence[str]]
) -> dict[str, tuple[int, int, int]]:
    """Per entity type ``(correct, predicted, gold)``, plus ``"overall"``; counts add up across shards."""
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for n, (gold_tags, predicted_tags) in enumerate(zip(references, predictions, strict=True)):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(f"entity_counts: sentence {n} has {len(gold_tags)} gold and {len(predicted_tags)} tags")
        gold, predicted = set(entities(gold_tags)), set(entities(predicted_tags))
        for chunks, slot in ((gold & predicted, 0), (predicted, 1), (gold, 2)):
            for type_, _, _ in chunks:
                counts[type_][slot] += 1
                counts["overall"][slot] += 1
    counts.setdefault("overall", [0, 0, 0])
    return {key: tuple(value) for key, value in counts.items()}


def precision_recall_f1(correct: int, predicted: int, gold: int) -> tuple[float, float, float]:
    """Micro precision, recall, F1 (0 where undefined, as seqeval's ``zero_division`` default reports)."""
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def entity_scores(references: Iterable[Sequence[str]], predictions: Iterable[Sequence[str]]) -> dict[str, float]:
    """``precision``, ``recall``, ``f1`` over all entities (seqeval's micro average)."""
    precision, recall, f1 = precision_recall_f1(*entity_counts(references, predictions)["overall"])
    return {"precision": precision, "recall": recall, "f1": f1}


# ---------------------------------------------------------------- SQuAD v2 rules
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(gold: str, predicted: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(predicted))


def answer_f1(gold: str, predicted: str) -> float:
    """Token-overlap F1 of the normalised answers; an empty side scores 1 only against another empty side."""
    gold_tokens, predicted_tokens = normalize_answer(gold).split(), normalize_answer(predicted).split()
    if not gold_tokens or not predicted_tokens:
        return float(gold_tokens == predicted_tokens)
    same = sum((collections.Counter(gold_tokens) & collections.Counter(predicted_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_example(golds: Sequence[str], predicted: str) -> tuple[int, float]:
    """``(exact match, F1)`` of one question: the best over its gold answers; no (non-empty) gold answer means
    unanswerable, scored against the empty prediction."""
    golds = [g for g in golds if normalize_answer(g)] or [""]
    return max(exact_match(g, predicted) for g in golds), max(answer_f1(g, predicted) for g in golds)


def squad_scores(references: Iterable[Sequence[str]], predictions: Iterable[str]) -> dict[str, float]:
    """``exact_match`` and ``f1`` (fractions) over questions, plus the same for the answerable (``has_answer_*``)
    and unanswerable (``no_answer_*``) ones where there are any."""
    groups: dict[str, list[tuple[int, float]]] = {"": [], "has_answer_": [], "no_answer_": []}
    for golds, predicted in zip(references, predictions, strict=True):
        score = squad_example(golds, predicted)
        groups[""].append(score)
        groups["has_answer_" if any(normalize_answer(g) for g in golds) else "no_answer_"].append(score)
    out = {}
    for prefix, scores in groups.items():
        if scores or not prefix:
            out[f"{prefix}exact_match"] = sum(s[0] for s in scores) / max(len(scores), 1)
            out[f"{prefix}f1"] = sum(s[1] for s in scores) / max(len(scores), 1)
            out[f"{prefix}total"] = len(scores)
    return out
