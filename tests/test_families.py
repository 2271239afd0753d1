"""Every masked-LM family, unpadded, against the stock padded Hugging Face model (tiny random configs from
transformers' own config classes, no download): MLM logits at the masked positions, loss and every gradient, in
fp32 and in bf16 (autocast on both sides; bf16 is emulated on AVX2 CPUs, hence one layer there). DeBERTa, which
cannot run unpadded, is refused in one line and trains padded."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from ds_bertopt.data.collate import pack_sequences
from ds_bertopt.errors import ConfigError
from ds_bertopt.model.bert import IGNORE_INDEX, SparseMLMHead
from ds_bertopt.model.families import FAMILIES, family_of
from ds_bertopt.model.pretrained import check_unpadded
from ds_bertopt.model.unpadded import UnpaddedMLM

VOCAB, PAD = 90, 1
LENGTHS = [7, 23, 2, 12, 17]
BERT_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    pad_token_id=PAD,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def config_of(name: str, layers: int = 2):
    """A tiny config of ``name``'s family; ModernBERT with a local layer whose window (|i-j| <= 4) cuts sequences."""
    if name == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=layers, n_heads=4, hidden_dim=48, max_position_embeddings=64,
            pad_token_id=PAD, dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
    if name == "modernbert":
        return transformers.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers + 1, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2,
            pad_token_id=PAD, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
        )  # fmt: skip
    classes = {
        "bert": "BertConfig",
        "roberta": "RobertaConfig",
        "xlm-roberta": "XLMRobertaConfig",
        "camembert": "CamembertConfig",
        "electra": "ElectraConfig",
        "deberta-v2": "DebertaV2Config",
    }
    extra = {"embedding_size": 16} if name == "electra" else {}  # the generator's own embedding width, projected
    return getattr(transformers, classes[name])(**{**BERT_LIKE, "num_hidden_layers": layers, **extra})


def make_model(name: str, layers: int = 2):
    """The family's masked-LM model, weights drawn wide enough that attention and positions matter."""
    torch.manual_seed(0)
    family = next(f for f in FAMILIES if name in f.model_types)
    config = config_of(name, layers)
    config._attn_implementation = "eager"  # an independent reference: the eager math with an additive mask
    model = getattr(transformers, family.mlm_class)(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
    return model.eval()


def samples(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in LENGTHS:
        ids = [rng.randrange(PAD + 3, VOCAB) for _ in range(n)]
        labels = [rng.randrange(VOCAB) if rng.random() < 0.3 else IGNORE_INDEX for _ in range(n)]
        labels[rng.randrange(n)] = rng.randrange(VOCAB)
        out.append({"input_ids": ids, "token_type_ids": [0] * n, "labels": labels})
    return out


def padded(batch: list[dict]) -> dict:
    longest = max(len(s["input_ids"]) for s in batch)
    out = {
        "input_ids": torch.full((len(batch), longest), PAD),
        "attention_mask": torch.zeros(len(batch), longest, dtype=torch.long),
        "labels": torch.full((len(batch), longest), IGNORE_INDEX),
    }
    for row, s in enumerate(batch):
        n = len(s["input_ids"])
        out["input_ids"][row, :n] = torch.tensor(s["input_ids"])
        out["attention_mask"][row, :n] = 1
        out["labels"][row, :n] = torch.tensor(s["labels"])
    return out


def grads(model) -> dict:
    assert all(p.grad.layout == torch.strided for p in model.parameters() if p.grad is not None)  # tied: dense sum
    out = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def stock_and_unpadded(name: str, dtype: torch.dtype, layers: int, fused_dropout: bool = False):
    """(stock loss, stock logits at the masked positions, grads), the same for ours."""
    model = make_model(name, layers)
    batch = samples()
    ref_batch = padded(batch)
    selected = ref_batch["labels"] != IGNORE_INDEX
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ref = model(**ref_batch)
    ref.loss.backward()
    ref_out = (ref.loss.detach().float(), ref.logits[selected].detach().float(), grads(model))
    wrapper = UnpaddedMLM(model, fused_dropout=fused_dropout).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = wrapper(**pack_sequences(batch))
    out.loss.backward()
    assert torch.equal(out.mlm_labels, ref_batch["labels"][selected])
    return ref_out, (out.loss.detach().float(), out.mlm_logits.detach().float(), grads(model)), wrapper


UNPADDED = ["bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "modernbert"]


@pytest.mark.parametrize("fused_dropout", [False, True], ids=["", "fused_dropout"])
@pytest.mark.parametrize("name", UNPADDED)
def test_fp32_logits_loss_and_every_gradient_match_the_stock_padded_model(name, fused_dropout):
    (ref_loss, ref_logits, ref_grads), (loss, logits, ours), wrapper = stock_and_unpadded(
        name, torch.float32, 2, fused_dropout
    )
    assert (wrapper.fused is not None) == fused_dropout and (not fused_dropout or "dropout x" in wrapper.fused[0])
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert ours.keys() == ref_grads.keys() and len(ours) == len(list(wrapper.model.parameters()))
    for key in ref_grads:
        torch.testing.assert_close(ours[key], ref_grads[key], atol=1e-4, rtol=1e-3, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", UNPADDED)
def test_bf16_logits_loss_and_gradients_match_the_stock_padded_model(name):
    (ref_loss, ref_logits, ref_grads), (loss, logits, ours), _ = stock_and_unpadded(name, torch.bfloat16, 1)
    torch.testing.assert_close(loss, ref_loss, atol=0.05, rtol=0.02)
    assert F.cosine_similarity(logits.flatten(), ref_logits.flatten(), dim=0) > 0.995
    flat_ref = torch.cat([ref_grads[k].flatten() for k in ref_grads])
    flat = torch.cat([ours[k].flatten() for k in ref_grads])
    assert ours.keys() == ref_grads.keys() and torch.isfinite(flat).all()
    assert F.cosine_similarity(flat, flat_ref, dim=0) > 0.99
    assert (flat - flat_ref).norm() < 0.1 * flat_ref.norm()


def test_what_the_parity_depends_on_is_checked():
    """The family rules these tests guard: without RoBERTa's position offset, or without ModernBERT's local window,
    the logits differ from the stock model's (so the parity above is not vacuous)."""
    for name, knob, value in (("roberta", "position_offset", 0), ("modernbert", "window", None)):
        model = make_model(name)
        batch = samples()
        ref = padded(batch)
        selected = ref["labels"] != IGNORE_INDEX
        with torch.no_grad():
            expected = model(**ref).logits[selected]
            wrapper = UnpaddedMLM(model).eval()
            setattr(wrapper, knob, value)
            if knob == "window":  # the window reaches attention through the model's own layers: drop it there
                for layer in model.model.layers:
                    layer.attn.sliding_window = None
            wrong = wrapper(**pack_sequences(batch)).mlm_logits
        assert (wrong - expected).abs().max() > 1e-2, name


def test_the_wrapped_model_still_runs_padded_batches():
    """The packed attention implementation falls back to SDPA with transformers' mask for a padded call."""
    model = make_model("roberta")
    batch = padded(samples())
    with torch.no_grad():
        before = model(**batch).logits
        UnpaddedMLM(model)
        after = model(**batch).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(after[mask], before[mask], atol=1e-4, rtol=1e-4)


def test_deberta_is_refused_unpadded_and_trains_padded():
    model = make_model("deberta-v2")
    assert family_of(model).unpadded_blocker
    with pytest.raises(ValueError, match="deberta-v2 cannot run unpadded"):
        UnpaddedMLM(model)
    with pytest.raises(ConfigError) as err:
        check_unpadded(family_of(model), unpadded=True)
    assert "\n" not in str(err.value) and "set model.unpadded false to train it padded" in str(err.value)
    check_unpadded(family_of(model), unpadded=False)
    batch = padded(samples())
    ref = model(**batch)
    out = SparseMLMHead(model)(**batch, token_type_ids=None)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["roberta", "modernbert"])
def test_padded_sparse_head_matches_the_stock_model(name):
    model = make_model(name)
    batch = padded(samples())
    ref = model(**batch)
    out = SparseMLMHead(model)(**batch, token_type_ids=torch.zeros_like(batch["input_ids"]))
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.mlm_logits, ref.logits[batch["labels"] != IGNORE_INDEX], atol=1e-4, rtol=1e-4)
