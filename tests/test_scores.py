"""The fine-tuning scores as pure functions: seqeval's entity semantics (BIO, IOB2, IOB1, IOBES) and micro F1,
SQuAD v2's normalisation, exact match and F1 (unanswerable questions against the empty answer), Pearson and
Spearman (average ranks for ties). Expected values are the ones seqeval's documentation, the official SQuAD v2
script and scipy give for the same inputs."""

from __future__ import annotations

import math

import pytest

from ds_bertopt import scores


def test_entities_read_bio_and_iob2_chunks_as_seqeval_does():
    # seqeval's README: get_entities(['B-PER', 'I-PER', 'O', 'B-LOC']) == [('PER', 0, 1), ('LOC', 3, 3)]
    assert scores.entities(["B-PER", "I-PER", "O", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]
    # IOB1 / lenient BIO: an I- after O starts an entity, a type change ends one
    assert scores.entities(["O", "I-PER", "I-PER", "I-LOC", "B-LOC", "I-LOC"]) == [
        ("PER", 1, 2),
        ("LOC", 3, 3),
        ("LOC", 4, 5),
    ]
    assert scores.entities(["B-PER", "B-PER", "I-ORG"]) == [("PER", 0, 0), ("PER", 1, 1), ("ORG", 2, 2)]
    assert scores.entities(["S-PER", "B-LOC", "E-LOC", "O"]) == [("PER", 0, 0), ("LOC", 1, 2)]
    assert scores.entities(["O", "O"]) == [] and scores.entities([]) == []
    assert scores.entities(["B-geo-loc", "I-geo-loc"]) == [("geo-loc", 0, 1)]  # types with hyphens (Twitter NER)


def test_entity_scores_are_seqevals_micro_average():
    # seqeval's README example: f1 0.50, precision 0.50, recall 0.50
    gold = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    assert scores.entity_scores(gold, pred) == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    counts = scores.entity_counts(gold, pred)
    assert counts["overall"] == (1, 2, 2) and counts["PER"] == (1, 1, 1) and counts["MISC"] == (0, 1, 1)
    assert scores.entity_scores([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    with pytest.raises(ValueError, match="sentence 0 has 2 gold and 1 tags"):
        scores.entity_counts([["O", "O"]], [["O"]])


def test_squad_v2_rules():
    assert scores.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert scores.exact_match("the Eiffel Tower", "Eiffel tower.") == 1
    assert scores.answer_f1("Denver Broncos", "the Broncos") == pytest.approx(2 / 3)
    assert scores.answer_f1("a", "") == 1.0  # "a" normalises to nothing: both empty
    assert scores.squad_example(["Broncos", "Denver Broncos"], "Denver Broncos won") == (0, pytest.approx(0.8))
    assert scores.squad_example([], "") == (1, 1.0) and scores.squad_example([], "Denver") == (0, 0.0)
    out = scores.squad_scores([["Denver Broncos"], []], ["Denver Broncos", "Denver"])
    assert out["exact_match"] == 0.5 and out["has_answer_exact_match"] == 1.0 and out["no_answer_f1"] == 0.0
    assert out["total"] == 2 and out["no_answer_total"] == 1


def test_pearson_and_spearman_match_scipy():
    # scipy.stats.pearsonr([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) -> 0.8; spearmanr([1, 2, 2, 3], [1, 3, 2, 4]) -> 0.9487
    assert scores.pearson([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert scores.average_ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]
    assert scores.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)
    assert math.isnan(scores.pearson([1, 1, 1], [1, 2, 3]))
    assert scores.accuracy([1, 0, 1], [1, 1, 1]) == pytest.approx(2 / 3)
