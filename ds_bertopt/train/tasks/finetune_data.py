"""What each fine-tuning task (``finetune.task``) reads, how its examples become model inputs, and how its
predictions become scores; :mod:`.finetune` runs them on the shared loop.

A task's *examples* are what it is scored on (texts, sentences, questions); its *samples* are what the model sees
(one per example, except question answering: one per window of a long context). Every sample is a dict that
:func:`ds_bertopt.data.collate.collate_task_batch` takes. Each class here has: ``read(path, split)`` (the pre-flight's
one-line errors), ``prepare(train, validation)`` (labels and their count), ``samples(tokenizer, data, ...)``,
``predict(outputs)`` (host predictions of one evaluated batch, per sample), ``example_predictions(...)`` and
``scores(data, predictions)`` (pure, :mod:`ds_bertopt.scores`).
"""

from __future__ import annotations

import numpy as np

from ...data.labelled import check_labels, load_labelled
from ...data.squad import best_answer, load_squad, qa_windows
from ...data.tagged import align_word_labels, load_tagged, tag_set, word_predictions
from ...errors import ConfigError
from ... import scores


class SequenceTask:
    """Classification and regression of a text or a text pair."""

    main_score = "eval_accuracy"

    def __init__(self, f, cap: float):
        self.f, self.cap = f, cap
        self.regression = f.task == "regression"
        if self.regression:
            self.main_score = "eval_pearson"

    def read(self, path: str, split: str):
        f = self.f
        names = () if self.regression else f.label_names
        return load_labelled(
            path, f.text_column, f.label_column, split, names, self.cap, f.text_pair_column, self.regression
        )

    def prepare(self, train, validation) -> int:
        if self.regression:
            self.label_names = ()
            return 1
        given = self.f.num_labels or (len(self.f.label_names) or None)
        return check_labels(train, validation, given, self.f.label_column)

    def describe(self, num_labels: int) -> str:
        pair = " pairs" if self.f.text_pair_column else ""
        return f"regression{pair}" if self.regression else f"{num_labels} classes{pair and ', text pairs'}"

    def samples(self, tokenizer, data, max_length: int) -> tuple[list[dict], np.ndarray]:
        pairs = list(data.pairs) if data.pairs is not None else None
        encoded = tokenizer(list(data.texts), pairs, truncation=True, max_length=max_length)
        types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
        out = [
            {"input_ids": ids, "token_type_ids": t, "label": label}
            for ids, t, label in zip(encoded["input_ids"], types, data.labels)
        ]
        return out, np.arange(len(out))

    def fingerprint(self, samples: list[dict]) -> list:
        return [np.asarray([s["label"] for s in samples], dtype=np.float64)]

    def predict(self, out: dict, batch: dict) -> list:  # noqa: ARG002
        logits = out["logits"].float()
        values = logits.reshape(-1) if self.regression else logits.argmax(-1)
        return values.cpu().tolist()

    def example_predictions(self, data, example: int, sample_predictions: list):  # noqa: ARG002
        return sample_predictions[0]

    def scores(self, data, predictions: list) -> dict:
        labels = list(data.labels)
        if self.regression:
            return {
                "eval_pearson": scores.pearson(predictions, labels),
                "eval_spearman": scores.spearman(predictions, labels),
            }
        return {"eval_accuracy": scores.accuracy(predictions, labels)}

    def line(self, record: dict) -> str:
        if self.regression:
            return f"Pearson {record['eval_pearson']:.4f}, Spearman {record['eval_spearman']:.4f}"
        return f"accuracy {record['eval_accuracy']:.4f}"


class TokenTask:
    """Token classification: a tag per word, read at each word's first sub-word."""

    main_score = "eval_f1"

    def __init__(self, f, cap: float):
        self.f, self.cap = f, cap

    def read(self, path: str, split: str):
        return load_tagged(path, self.f.tokens_column, self.f.tags_column, split, self.f.label_names, self.cap)

    def prepare(self, train, validation) -> int:
        self.label_names = tag_set(train, validation, self.f.label_names)
        self.ids = {tag: i for i, tag in enumerate(self.label_names)}
        return len(self.label_names)

    def describe(self, num_labels: int) -> str:
        return f"{num_labels} tags"

    def samples(self, tokenizer, data, max_length: int) -> tuple[list[dict], np.ndarray]:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("finetune.task token_classification needs a fast tokenizer (word ids per token)")
        encoded = tokenizer(
            [list(w) for w in data.words], is_split_into_words=True, truncation=True, max_length=max_length
        )
        types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
        out = []
        for n, (ids, t, tags) in enumerate(zip(encoded["input_ids"], types, data.tags)):
            labels, words = align_word_labels(encoded.word_ids(n), [self.ids[tag] for tag in tags])
            out.append({"input_ids": ids, "token_type_ids": t, "labels": labels, "words": words})
        return out, np.arange(len(out))

    def fingerprint(self, samples: list[dict]) -> list:
        return [np.fromiter((x for s in samples for x in s["labels"]), dtype=np.int64)]

    def predict(self, out: dict, batch: dict) -> list:
        predicted = out["logits"].argmax(-1).cpu()
        counts = [sum(1 for x in labels if x != -100) for labels in batch["sample_labels"]]
        return [p.tolist() for p in predicted.split(counts)]

    def example_predictions(self, data, example: int, sample_predictions: list):
        sample = self.eval_samples[example]
        return word_predictions(sample["words"], sample_predictions[0], len(data.words[example]), self.label_names)

    def scores(self, data, predictions: list) -> dict:
        counts = scores.entity_counts([list(t) for t in data.tags], predictions)
        precision, recall, f1 = scores.precision_recall_f1(*counts["overall"])
        tokens = [(g, p) for gold, pred in zip(data.tags, predictions) for g, p in zip(gold, pred)]
        accuracy = sum(g == p for g, p in tokens) / max(len(tokens), 1)
        return {"eval_precision": precision, "eval_recall": recall, "eval_f1": f1, "eval_token_accuracy": accuracy}

    def line(self, record: dict) -> str:
        return (
            f"entity F1 {record['eval_f1']:.4f} (precision {record['eval_precision']:.4f}, recall "
            f"{record['eval_recall']:.4f}), token accuracy {record['eval_token_accuracy']:.4f}"
        )


class QuestionAnsweringTask:
    """Extractive question answering over windows of the context."""

    main_score = "eval_f1"

    def __init__(self, f, cap: float):
        self.f, self.cap = f, cap

    def read(self, path: str, split: str):
        f = self.f
        return load_squad(path, f.question_column, f.context_column, f.answers_column, split, self.cap)

    def prepare(self, train, validation) -> int:  # noqa: ARG002
        self.allow_null = train.unanswerable > 0
        self.label_names = ()
        return 2

    def describe(self, num_labels: int) -> str:  # noqa: ARG002
        return "question answering"

    def samples(self, tokenizer, data, max_length: int) -> tuple[list[dict], np.ndarray]:
        windows = qa_windows(tokenizer, data, max_length, self.f.stride)
        out = [
            {"input_ids": ids, "token_type_ids": t, "start_position": int(s), "end_position": int(e), "offsets": o}
            for ids, t, s, e, o in zip(
                windows.input_ids, windows.token_type_ids, windows.start, windows.end, windows.offsets
            )
        ]
        return out, windows.example

    def fingerprint(self, samples: list[dict]) -> list:
        return [np.asarray([(s["start_position"], s["end_position"]) for s in samples], dtype=np.int64)]

    def predict(self, out: dict, batch: dict) -> list:
        lengths = batch["sample_lengths"]
        start, end = out["start_logits"].float().cpu().numpy(), out["end_logits"].float().cpu().numpy()
        return [(start[i, :n], end[i, :n]) for i, n in enumerate(lengths)]

    def example_predictions(self, data, example: int, sample_predictions: list) -> str:
        windows = [
            (start, end, self.eval_samples[w]["offsets"])
            for w, (start, end) in zip(self.eval_windows[example], sample_predictions)
        ]
        return best_answer(
            windows, data.contexts[example], self.f.max_answer_length, self.allow_null, self.f.null_score_threshold
        )

    def scores(self, data, predictions: list) -> dict:
        golds = [[text for text, _ in answers] for answers in data.answers]
        out = scores.squad_scores(golds, predictions)
        return {f"eval_{k}": v for k, v in out.items()}

    def line(self, record: dict) -> str:
        line = f"exact match {record['eval_exact_match']:.4f}, F1 {record['eval_f1']:.4f}"
        if "eval_no_answer_total" in record and "eval_has_answer_total" in record:
            line += (
                f" (answerable: F1 {record['eval_has_answer_f1']:.4f}; unanswerable: exact "
                f"{record['eval_no_answer_exact_match']:.4f})"
            )
        return line


TASKS = {
    "classification": SequenceTask,
    "regression": SequenceTask,
    "token_classification": TokenTask,
    "question_answering": QuestionAnsweringTask,
}


def task_data(f, cap: float):
    return TASKS[f.task](f, cap)
