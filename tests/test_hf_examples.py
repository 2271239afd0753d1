"""``examples/run_glue.py``, ``run_ner.py`` and ``run_qa.py``: stock-style ``Trainer`` scripts whose ``BertOptTrainer``
runs the task heads packed. ``run_glue`` in process on text pairs (no launcher); ``run_qa`` under the ``deepspeed``
launcher (ZeRO 3, preset balanced, the planner, windows padded up front) and ``run_ner`` under ``accelerate launch``
(ZeRO 2, the gradient-norm cache on packed rows), 2 ranks each, a tiny BERT with MiniLM's tokenizer, a few steps."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

from _launch import deepspeed_cmd, run
from ds_bertopt.testing.distributed import free_port
from test_finetune import _tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _ds_json(path: Path, stage: int, bertopt: dict) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": False},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 1_000_000, "bertopt": {"model": {"unpadded": True}, **bertopt},
    }  # fmt: skip
    path.write_text(json.dumps(config))
    return path


COMMON = [
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_steps", "3",
    "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    "--seed", "0",
]  # fmt: skip


def test_run_glue_trains_text_pairs_packed(tmp_path):
    """In process: question/passage pairs through run_glue's own preprocessing (padded to max_seq_length up front, as
    its default does) arrive as packed rows of real tokens; it trains, evaluates accuracy and saves the stock model."""
    import run_glue

    from ds_bertopt.integrations.hf import BertOptTrainer

    rows = ["question,passage,label"] + [f"is {i} even,{i} is a number {'even ' * (i % 5)},{i % 2}" for i in range(24)]
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    model = _tiny_checkpoint(tmp_path / "model")
    argv = [
        "--model_name_or_path", model, "--train_file", str(tmp_path / "pairs.csv"), "--validation_file",
        str(tmp_path / "pairs.csv"), "--sentence1_key", "question", "--sentence2_key", "passage",
        "--max_seq_length", "48", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *COMMON,
    ]  # fmt: skip
    bertopt = {"model": {"unpadded": True}, "wtacrs": {"preset": "exact"}}
    trainer = run_glue.build_trainer(argv, trainer_class=functools.partial(BertOptTrainer, bertopt=bertopt))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] < 4 * 48  # the padding cut off
    assert (batch["token_type_ids"] == 1).any()  # the passage: the pair's second segment
    trainer.train()
    assert 0.0 <= trainer.evaluate()["eval_accuracy"] <= 1.0
    trainer.save_model()
    saved = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert type(saved).__name__ == "BertForSequenceClassification"


def _check_saved(out: Path, cls, start: str) -> None:
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    first = cls.from_pretrained(start, ignore_mismatched_sizes=True)
    weight = lambda m: m.bert.encoder.layer[1].output.dense.weight  # noqa: E731
    assert not torch.equal(weight(model), weight(first))


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(420)
def test_run_qa_under_the_deepspeed_launcher(tmp_path, shared_data):
    model = _tiny_checkpoint(tmp_path / "model")
    config = _ds_json(
        tmp_path / "ds.json", 3, {"sampler": {"strategy": "packed_node_balance"}, "wtacrs": {"preset": "balanced"}}
    )
    out = tmp_path / "out"
    script = [
        "examples/run_qa.py", "--model_name_or_path", model, "--train_file", str(shared_data / "qa" / "disfl_qa.jsonl"),
        "--version_2_with_negative", "true", "--max_seq_length", "64", "--doc_stride", "16",
        "--max_train_samples", "48", "--max_eval_samples", "16", "--output_dir", str(out), *COMMON,
    ]  # fmt: skip
    port = free_port()
    launcher = deepspeed_cmd("--num_gpus", "2", "--master_port", str(port))
    proc = run([*launcher, *script, "--deepspeed", str(config)], 400, HF_DATASETS_CACHE=str(tmp_path / "hf"))
    assert "BertForQuestionAnswering (bert) trains on packed, padding-free question answering batches" in proc.stdout
    assert "wtacrs: preset balanced" in proc.stdout and "sampler: packed_node_balance plan" in proc.stdout
    scores = json.loads((out / "eval_results.json").read_text())
    assert scores["eval_total"] == 16 and all(math.isfinite(scores[k]) for k in ("eval_exact_match", "eval_f1"))
    _check_saved(out, transformers.AutoModelForQuestionAnswering, model)


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(420)
def test_run_ner_under_accelerate_launch(tmp_path, shared_data):
    model = _tiny_checkpoint(tmp_path / "model")
    wtacrs = {"enabled": True, "ratio": 0.3, "grad_norm_cache": True, "targets": ["ffn_out", "qkv"]}
    config = _ds_json(tmp_path / "ds.json", 2, {"wtacrs": wtacrs})
    out = tmp_path / "out"
    launcher = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--use_deepspeed", "--deepspeed_config_file",
        str(config), "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip
    script = [
        "examples/run_ner.py", "--model_name_or_path", model, "--train_file", str(shared_data / "ner" / "train.conll"),
        "--validation_file", str(shared_data / "ner" / "dev.conll"), "--max_train_samples", "48",
        "--max_eval_samples", "24", "--ignore_mismatched_sizes", "true", "--output_dir", str(out), *COMMON,
    ]  # fmt: skip
    proc = run([*launcher, *script], 400, HF_DATASETS_CACHE=str(tmp_path / "hf"))
    assert (
        "BertForTokenClassification (bert) trains on packed, padding-free token classification batches" in proc.stdout
    )
    scores = json.loads((out / "eval_results.json").read_text())
    assert all(0.0 <= scores[f"eval_{k}"] <= 1.0 for k in ("precision", "recall", "f1")), scores
    _check_saved(out, transformers.AutoModelForTokenClassification, model)
