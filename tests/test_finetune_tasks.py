"""Fine-tuning tasks (``finetune.task``): readers and their one-line errors, sub-word label alignment, question
answering windows and the answer chosen across them, batches packed and padded, and every task end to end through
the real launcher on real files (2 ranks, a tiny random BERT, ZeRO 0-3 across the four)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_bertopt.data.collate import collate_task_batch
from ds_bertopt.data.squad import answer_tokens, best_answer
from ds_bertopt.data.tagged import align_word_labels, word_predictions
from ds_bertopt.testing.distributed import free_port, start_processes
from ds_bertopt.train.tasks.finetune import main
from _launch import deepspeed_cmd, run
from test_finetune import _tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def test_first_sub_word_labels_and_word_predictions():
    # "Empire State Building" -> [CLS] em ##pire state building [SEP]
    labels, words = align_word_labels([None, 0, 0, 1, 2, None], [1, 2, 2])
    assert labels == [-100, 1, -100, 2, 2, -100] and words == [0, 1, 2]
    # word 3 was cut off by truncation: it is predicted O
    assert word_predictions(words, [1, 2, 0], 4, ["O", "B-facility", "I-facility"]) == [
        "B-facility",
        "I-facility",
        "O",
        "O",
    ]


def test_answer_tokens_and_the_best_answer_across_windows():
    context = "The cat sat on the mat"
    # window 1 holds "The cat sat", window 2 "sat on the mat"; -1: question and special tokens
    w1 = np.array([[-1, -1], [0, 3], [4, 7], [8, 11], [-1, -1]])
    w2 = np.array([[-1, -1], [8, 11], [12, 14], [15, 18], [19, 22], [-1, -1]])
    assert answer_tokens(w2, 19, 22) == (4, 4) and answer_tokens(w1, 19, 22) == (0, 0)  # not in window 1: [CLS]
    low = -5.0
    s1, e1 = np.array([0.0, low, 1.0, low, low]), np.array([0.0, low, 1.0, low, low])
    s2, e2 = np.array([0.0, low, low, low, 3.0, low]), np.array([0.0, low, low, low, 3.0, low])
    assert best_answer([(s1, e1, w1), (s2, e2, w2)], context, 30, allow_null=True) == "mat"
    assert best_answer([(s1, e1, w1)], context, 30, allow_null=True) == "cat"
    # the no-answer score (both [CLS] logits) wins by more than the threshold
    null = (np.array([9.0, low, 1.0, low, low]), e1, w1)
    assert best_answer([null], context, 30, allow_null=True) == ""
    assert best_answer([null], context, 30, allow_null=False) == "cat"
    assert best_answer([(s1, e1, w1)], context, 30, allow_null=True, null_threshold=-3.0) == ""


def test_task_batches_packed_and_padded_agree():
    samples = [
        {"input_ids": [101, 5, 6, 102], "token_type_ids": [0] * 4, "labels": [-100, 3, -100, -100]},
        {"input_ids": [101, 7, 102], "token_type_ids": [0] * 3, "labels": [-100, 1, -100]},
    ]
    packed = collate_task_batch(samples, "token_classification", packed=True, pad_id=0)
    padded = collate_task_batch(samples, "token_classification", packed=False, pad_id=0, pad_multiple=8)
    assert packed["label_positions"].tolist() == [1, 5] and padded["label_positions"].tolist() == [1, 9]
    assert packed["labels"].tolist() == padded["labels"].tolist() == [3, 1]
    assert packed["num_tokens"] == padded["num_tokens"] == 7 and packed["num_targets"] == 2
    assert packed["pad_index"].tolist() == [0, 1, 2, 3, 4, 5, 6]
    qa = [dict(s, start_position=1, end_position=2) for s in samples]
    assert collate_task_batch(qa, "question_answering", packed=True, pad_id=0)["end_positions"].tolist() == [2, 2]


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def errors_cases(d: Path) -> list:
    bio = _write(d / "broken.conll", "Empire\tB-facility\nState\n\nfoo\tO\n")
    tag = _write(d / "tag.conll", "Empire\tB-facility\nState\tfacility\n")
    squad = json.dumps(
        {"question": "Where?", "context": "on the mat", "answers": {"text": ["mat"], "answer_start": [3]}}
    )
    pairs = _write(d / "pairs.csv", "question,passage,label\nis it,yes it is,1\n")
    floats = _write(d / "floats.csv", "text,label\ngood,1.5\n")
    words = _write(d / "words.csv", "text,score\ngood,high\n")
    return [
        (["--task", "token_classification", "--train_file", bio], f"{bio} line 2: expected 'word<TAB>tag'"),
        (["--task", "token_classification", "--train_file", tag], f"{tag} line 2: tag 'facility' is not O or B-/I-"),
        (
            ["--task", "question_answering", "--train_file", _write(d / "qa.jsonl", squad + "\n")],
            "line 1: answers.text[0] 'mat' is not at answer_start 3 of the context (it holds 'the' there)",
        ),
        (
            ["--train_file", pairs, "--text_column", "question", "--text_pair_column", "passages"],
            "has no column 'passages' (columns: question, passage, label)",
        ),
        (["--train_file", floats], "label '1.5' is not an integer class label (a number with a fraction"),
        (
            ["--task", "regression", "--train_file", words, "--label_column", "score"],
            "score 'high' is not a number (finetune.task regression needs numeric labels)",
        ),
        (
            ["--task", "question_answering", "--train_file", pairs],
            "pairs.csv: unsupported format; use .jsonl, .json or a directory saved by datasets",
        ),
    ]


def test_each_task_refuses_bad_input_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "ds_configs" / "finetune_zero0.json")
    for args, message in errors_cases(tmp_path):
        assert main(["--deepspeed_config", config, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert message is None or message in err[0], err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_dead_fields_name_what_each_task_ignores():
    from ds_bertopt.config import FinetuneConfig

    dead = FinetuneConfig(task="question_answering").dead_fields()
    assert dead["text_pair_column"] == 'only classification and regression read it; task is "question_answering"'
    assert "question_column" not in dead
    assert set(FinetuneConfig(task="token_classification").dead_fields()) >= {"text_column", "num_labels", "doc_stride"}
    assert "label_names" in FinetuneConfig(task="regression").dead_fields()
    assert "text_pair_column" not in FinetuneConfig().dead_fields()


LAUNCHES = {
    # task: (ZeRO stage, training and validation files, overrides)
    "classification": (
        0,
        ("boolq/train.csv", "boolq/dev.csv"),
        ["--text_column", "question", "--text_pair_column", "passage"],
    ),
    "regression": (
        1,
        None,
        ["--text_column", "sentence1", "--text_pair_column", "sentence2", "--label_column", "score"],
    ),
    "token_classification": (2, ("ner/train.conll", "ner/dev.conll"), []),
    "question_answering": (3, ("qa/disfl_qa.jsonl", "qa/disfl_qa.jsonl"), ["-o", "finetune.doc_stride=16"]),
}
SCORES = {
    "classification": "eval_accuracy",
    "regression": "eval_pearson",
    "token_classification": "eval_f1",
    "question_answering": "eval_f1",
}


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(300)
@pytest.mark.skipif(not (SHARED / "boolq").is_dir(), reason="../shared/data is absent")
@pytest.mark.parametrize("task", list(LAUNCHES))
def test_every_task_fine_tunes_unpadded_through_the_launcher(task, tmp_path):
    """2 ranks, a tiny random BERT, packed micro-batches: the task's data line, 3 finite training steps, an evaluation
    of the whole (capped) dev set with the task's scores, and the final model saved loadable."""
    stage, files, extra = LAUNCHES[task]
    if files is None:
        rows = ["sentence1,sentence2,score"] + [
            f"good {i} movie,a fine film {i % 7},{(i % 5) * 1.1:.1f}" for i in range(64)
        ]
        files = (_write(tmp_path / "sts.csv", "\n".join(rows) + "\n"),) * 2
    else:
        files = tuple(str(SHARED / f) for f in files)
    model = _tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "run"
    cmd = deepspeed_cmd(
        "--num_gpus", "2", "--master_port", str(free_port()), "launch/finetune.py",
        "--deepspeed_config", f"ds_configs/finetune_zero{stage}.json", "--task", task,
        "--model_name_or_path", model, "--train_file", files[0], "--validation_file", files[1],
        "--output_dir", str(out), "--max_steps", "3", "--log_every", "1", "--max_seq_length", "64",
        "-o", "finetune.max_train_samples=48", "-o", "finetune.max_eval_samples=24", "-o", "finetune.eval_batch_size=8",
        "-o", "deepspeed.train_micro_batch_size_per_gpu=4", "-o", 'train.precision="fp32"', *extra,
    )  # fmt: skip
    proc = run(cmd, timeout=280, HF_HUB_OFFLINE="1")
    output = proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), output[-3000:]
    assert len(evals) == 1 and evals[0]["eval_examples"] == 24 and math.isfinite(evals[0]["eval_loss"])
    assert SCORES[task] in evals[0], evals
    assert f"ZeRO {stage}" in output and "unpadded (unpadded attention: exact per-sequence SDPA loop" in output
    assert "training examples" in output and (out / "final" / "config.json").is_file()


@pytest.mark.timeout(300)
def test_every_task_trains_alike_under_zero_0_to_3(tmp_path):
    """Every task's packed head through real ``deepspeed.initialize`` on 2 gloo ranks at ZeRO 0, 1, 2 and 3 (one
    spawn, fp32, tiny BERT): the same losses, and every parameter, the heads' included, moved by the same update as
    at ZeRO 0 (to 1e-3 of the largest update). The launcher runs each task end to end at one stage (above)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    import task_zero_worker

    start_processes(task_zero_worker.run, (2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for task, stages in results.items():
            reference = stages["0"]
            assert all(v > 0 for v in reference["updates"].values()), (task, reference["updates"])
            # a parameter whose gradients are near Adam's eps moves by little, and by reduction-order noise
            scale = 1e-3 * max(reference["updates"].values())
            for stage in ("1", "2", "3"):
                assert stages[stage]["losses"] == pytest.approx(reference["losses"], rel=1e-5), (task, stage)
                assert stages[stage]["updates"].keys() == reference["updates"].keys()
                for name, update in stages[stage]["updates"].items():
                    expected = reference["updates"][name]
                    assert update == pytest.approx(expected, rel=1e-3, abs=scale), (task, stage, name)
