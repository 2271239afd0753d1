"""The GPU-sized configs (docs/gpu.md): each is accepted by the pre-flight at 1,024 ranks (8 per node) on CUDA, and a
miniature of it (tiny shapes, the same features: unpadded model, packed_node_balance batches, bucket clip, its
optimizer, schedule, precision and ZeRO stage, its init_checkpoint) trains a few steps, checkpoints and saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_bertopt.cli import main as cli_main
from ds_bertopt.config import load_config
from ds_bertopt.testing.distributed import spawn_ranks

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIGS = (
    "bert_base.json",
    "bert_base_phase2.json",
    "bert_large.json",
    "bert_large_phase2.json",
    "bert_large_lamb.json",
    "bert_large_adam.json",
    "mlperf_bert_large.json",
)
TINY_MODEL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_uses_the_product_and_is_accepted_at_1024_ranks(name, tmp_path, capsys):
    b = load_config(str(REPO / "ds_configs" / name)).bertopt
    assert b.model.unpadded and b.sampler.strategy == "packed_node_balance" and b.bucket_clip.enabled, name
    argv = ["config", f"ds_configs/{name}", "--world-size", "1024", "--ranks-per-node", "8", "--device", "cuda"]
    assert cli_main([*argv, "--output_dir", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    resolved = json.loads(capsys.readouterr().out)["deepspeed"]
    ds = resolved
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 1024


def test_the_mlperf_config_is_the_reference_recipe():
    """MLPerf BERT phase 2 (mlcommons/logging rcps_bert.json, ``bert_ref_8192``): seq 512, LAMB from the phase-1
    checkpoint, global batch 8,192, to masked-LM accuracy 0.720."""
    cfg = load_config(str(REPO / "ds_configs" / "mlperf_bert_large.json"))
    b, ds = cfg.bertopt, cfg.deepspeed
    assert ds["train_batch_size"] == 8192 and b.data.max_seq_length == 512 and b.model.init_checkpoint
    assert (b.optimizer.type, b.optimizer.lr, b.optimizer.betas) == ("lamb", 0.00288293, (0.88, 0.88))
    assert (b.optimizer.weight_decay, b.optimizer.eps) == (0.0166629, 1e-6)
    s = b.schedule
    assert (s.warmup_steps, s.start_warmup_step, s.decay_steps, s.power) == (287, -76, 600, 1.0)
    assert b.train.target_eval_accuracy == 0.72 and b.train.max_steps == 600


def _tiny_checkpoint(path: Path) -> None:
    """A random BERT MLM at tiny shapes with MiniLM-L6's tokenizer, as a phase-1 ``final/`` would be."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from ds_bertopt.model.local import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **TINY_MODEL)
    BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _miniatures(rank: int, world: int, workdir: str, corpus: str) -> dict:
    from ds_bertopt.train.tasks.pretrain import main

    work = Path(workdir)
    checkpoint = work / "phase1"
    _tiny_checkpoint(checkpoint)
    codes = {}
    for name in GPU_CONFIGS:
        cfg = load_config(str(REPO / "ds_configs" / name))
        overrides = [
            "train.max_steps=2",
            "train.eval_every=1",
            "train.log_every=1",
            "data.max_eval_samples=8",
            "data.max_seq_length=64",
            f"data.cache_dir={work / 'cache'}",
            "deepspeed.train_micro_batch_size_per_gpu=2",
            "deepspeed.csv_monitor.enabled=false",
        ]
        if "train_batch_size" in cfg.deepspeed:
            overrides.append("deepspeed.train_batch_size=4")
        if cfg.bertopt.model.init_checkpoint:
            overrides += [f"model.init_checkpoint={checkpoint}", f"data.tokenizer={checkpoint}"]
        else:
            overrides += [f"model.{key}={value}" for key, value in TINY_MODEL.items()]
            overrides.append("data.tokenizer_vocab_size=1000")
        argv = ["--deepspeed_config", str(REPO / "ds_configs" / name), "--output_dir", str(work / name)]
        argv += ["--train_file", corpus]
        for override in overrides:
            argv += ["-o", override]
        codes[name] = main(argv)
    return codes


@pytest.mark.slow
def test_a_miniature_of_each_gpu_config_trains(tmp_path, small_corpus):
    codes = spawn_ranks(_miniatures, 1, str(tmp_path), str(small_corpus), timeout=600)[0]
    assert codes == {name: 0 for name in GPU_CONFIGS}
    for name in GPU_CONFIGS:
        out = tmp_path / name
        assert (out / "final" / "config.json").is_file(), f"{name}: no final model"
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if "loss" in r] == [1, 2], f"{name}: {lines}"
