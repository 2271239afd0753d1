"""Every fine-tuning head, unpadded, against the stock padded Hugging Face model of each plain-attention family (tiny
random configs, no download): sequence classification and regression (the first token per sequence; ModernBERT's
mean pooling too), token classification (the labelled tokens) and question answering (start and end logits per
token): logits, loss and every gradient, in fp32 and in bf16 (autocast on both sides)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from ds_bertopt.data.collate import collate_task_batch
from ds_bertopt.labels import IGNORE_INDEX
from ds_bertopt.model.heads import (
    UnpaddedTaskModel,
    sequence_losses,
    span_losses,
    task_of,
    token_losses,
)
from test_families import PAD, VOCAB, config_of, grads

FAMILIES = ["bert", "roberta", "distilbert", "electra", "modernbert"]
TASKS = ["classification", "regression", "token_classification", "question_answering"]
CLASS = {
    "classification": "ForSequenceClassification",
    "regression": "ForSequenceClassification",
    "token_classification": "ForTokenClassification",
    "question_answering": "ForQuestionAnswering",
}
PREFIX = {
    "bert": "Bert",
    "roberta": "Roberta",
    "distilbert": "DistilBert",
    "electra": "Electra",
    "modernbert": "ModernBert",
}


def make_model(family: str, task: str, layers: int = 2, pooling: str = "cls"):
    torch.manual_seed(0)
    config = config_of(family, layers)
    config.num_labels = {"regression": 1, "token_classification": 5}.get(task, 3 if task == "classification" else 2)
    config._attn_implementation = "eager"  # an independent reference: the eager math with an additive mask
    if family == "modernbert":
        config.classifier_pooling = pooling
    model = getattr(transformers, PREFIX[family] + CLASS[task])(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
    return model.eval()


def samples(lengths, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        labels = [rng.randrange(5) if rng.random() < 0.5 else IGNORE_INDEX for _ in range(n)]
        labels[rng.randrange(n)] = rng.randrange(5)
        out.append(
            {
                "input_ids": [rng.randrange(PAD + 3, VOCAB) for _ in range(n)],
                "token_type_ids": [0] * n,
                "label": rng.randrange(3),
                "labels": labels,
                "start_position": rng.randrange(n),
                "end_position": rng.randrange(n),
            }
        )
    return out


def stock(model, task: str, batch: dict, dtype) -> tuple:
    """(loss, logits at real positions, grads) of the stock padded model, its own loss (regression: float labels)."""
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if task in ("classification", "regression"):
        kwargs["labels"] = batch["labels"].float() if task == "regression" else batch["labels"]
    elif task == "token_classification":
        labels = torch.full(batch["input_ids"].shape, IGNORE_INDEX).reshape(-1)
        labels[batch["label_positions"]] = batch["labels"]
        kwargs["labels"] = labels.view(batch["input_ids"].shape)
    else:
        kwargs.update(start_positions=batch["start_positions"], end_positions=batch["end_positions"])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(**kwargs)
    out.loss.backward()
    if task == "token_classification":
        logits = out.logits.reshape(-1, out.logits.shape[-1])[batch["label_positions"]]
    elif task == "question_answering":
        logits = torch.stack([out.start_logits, out.end_logits], -1)[batch["attention_mask"].bool()]
    else:
        logits = out.logits
    return out.loss.detach().float(), logits.detach().float(), grads(model)


def unpadded(model, task: str, batch: dict, dtype) -> tuple:
    wrapper = UnpaddedTaskModel(model, attention="sdpa_loop").eval()
    keys = ("input_ids", "cu_seqlens", "token_type_ids", "position_ids", "max_seqlen", "seq_lengths")
    extra = {"label_positions": batch["label_positions"]} if task == "token_classification" else {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = wrapper(**{k: batch[k] for k in keys}, **extra)
    if task in ("classification", "regression"):
        loss = sequence_losses(out.logits, batch["labels"], task == "regression").mean()
        logits = out.logits
    elif task == "token_classification":
        loss, logits = token_losses(out.logits, batch["labels"]).mean(), out.logits
    else:
        starts = torch.tensor([n for n in batch["seq_lengths"]]).cumsum(0) - torch.tensor(batch["seq_lengths"])
        start = torch.stack([out.start_logits[s : s + n] for s, n in zip(starts, batch["seq_lengths"])])
        end = torch.stack([out.end_logits[s : s + n] for s, n in zip(starts, batch["seq_lengths"])])
        loss = span_losses(start, end, batch["start_positions"], batch["end_positions"]).mean()
        logits = torch.stack([out.start_logits, out.end_logits], -1)
    loss.backward()
    return loss.detach().float(), logits.detach().float(), grads(model), wrapper


def both(family: str, task: str, dtype, layers: int = 2, pooling: str = "cls"):
    # question answering's stock loss softmaxes over padding positions too: equal lengths make it the padding-free one
    lengths = [9, 9, 9] if task == "question_answering" else [7, 23, 2, 12]
    batch = samples(lengths)
    model = make_model(family, task, layers, pooling)
    assert task_of(model) == task
    ref = stock(model, task, collate_task_batch(batch, task, packed=False, pad_id=PAD), dtype)
    ours = unpadded(model, task, collate_task_batch(batch, task, packed=True, pad_id=PAD), dtype)
    return ref, ours


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_loss_and_every_gradient_match_the_stock_padded_model(family, task):
    (ref_loss, ref_logits, ref_grads), (loss, logits, ours, wrapper) = both(family, task, torch.float32)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert ours.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(ours[key], ref_grads[key], atol=1e-4, rtol=1e-3, msg=lambda m, k=key: f"{k}: {m}")
    assert not any(k.startswith("hf.") for k in wrapper.state_dict())  # the wrapped model's state dict, once


def test_modernbert_mean_pooling_matches_the_stock_model():
    (ref_loss, ref_logits, ref_grads), (loss, logits, ours, _) = both(
        "modernbert", "classification", torch.float32, pooling="mean"
    )
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for key in ref_grads:
        torch.testing.assert_close(ours[key], ref_grads[key], atol=1e-4, rtol=1e-3)


def test_question_answering_logits_match_at_every_real_position_of_unequal_sequences():
    batch = samples([7, 23, 2, 12])
    model = make_model("bert", "question_answering")
    ref = stock(
        model,
        "question_answering",
        collate_task_batch(batch, "question_answering", packed=False, pad_id=PAD),
        torch.float32,
    )
    packed = collate_task_batch(batch, "question_answering", packed=True, pad_id=PAD)
    wrapper = UnpaddedTaskModel(model, attention="sdpa_loop").eval()
    keys = ("input_ids", "cu_seqlens", "token_type_ids", "position_ids", "max_seqlen", "seq_lengths", "pad_index")
    out = wrapper(**{k: packed[k] for k in keys})
    assert out.start_logits.shape == (4, 23)
    assert torch.isinf(out.start_logits[2, 2:]).all()  # beyond the sequence: -inf, never a candidate
    real = torch.isfinite(out.start_logits)
    torch.testing.assert_close(
        torch.stack([out.start_logits[real], out.end_logits[real]], -1), ref[1], atol=1e-4, rtol=1e-4
    )


@pytest.mark.precision
@pytest.mark.parametrize("task", TASKS)
def test_bf16_logits_loss_and_gradients_match_the_stock_padded_model(task):
    (ref_loss, ref_logits, ref_grads), (loss, logits, ours, _) = both("bert", task, torch.bfloat16, layers=1)
    torch.testing.assert_close(loss, ref_loss, atol=0.05, rtol=0.02)
    assert F.cosine_similarity(logits.flatten(), ref_logits.flatten(), dim=0) > 0.995
    flat_ref = torch.cat([ref_grads[k].flatten() for k in ref_grads])
    flat = torch.cat([ours[k].flatten() for k in ref_grads])
    assert ours.keys() == ref_grads.keys() and torch.isfinite(flat).all()
    assert F.cosine_similarity(flat, flat_ref, dim=0) > 0.99
    assert (flat - flat_ref).norm() < 0.1 * flat_ref.norm()


def test_deberta_task_models_are_refused_unpadded():
    config = config_of("deberta-v2")
    config.num_labels = 2
    with pytest.raises(ValueError, match="deberta-v2 cannot run unpadded"):
        UnpaddedTaskModel(transformers.DebertaV2ForSequenceClassification(config))
