"""Tests of the unpadded BERT pretraining forward against the stock padded Hugging Face models (fp32, CPU); the other
families are in test_families.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ds_bertopt.data.collate import pack_sequences, with_mlm_labels
from ds_bertopt.model.bert import PretrainOutput
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

from ds_bertopt.model.unpadded import (
    IGNORE_INDEX,
    UnpaddedBert,
    packed_attention,
    probe_varlen,
    sdpa_loop_attention,
    sequence_lengths,
    token_counts,
    varlen_usable,
)

VOCAB = 120
LENGTHS = [7, 31, 2, 64, 19, 45]


def tiny_config(**overrides) -> BertConfig:
    config = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config.update(overrides)
    cfg = BertConfig(**config)
    cfg._attn_implementation = "eager"  # an independent reference: HF's eager math with an additive padding mask
    return cfg


def make_model(cls=BertForMaskedLM, seed=0, **overrides):
    torch.manual_seed(seed)
    return cls(tiny_config(**overrides))


def make_samples(lengths, seed=0, nsp=False):
    """Already-masked ids with labels: about 20 % of positions per sample carry a target (at least one)."""
    gen = random.Random(seed)
    samples = []
    for n in lengths:
        ids = [gen.randrange(1, VOCAB) for _ in range(n)]
        split = gen.randrange(1, n + 1)
        types = [0] * split + [1] * (n - split)
        labels = [gen.randrange(VOCAB) if gen.random() < 0.2 else IGNORE_INDEX for _ in range(n)]
        if all(label == IGNORE_INDEX for label in labels):
            labels[gen.randrange(n)] = gen.randrange(VOCAB)
        sample = {"input_ids": ids, "token_type_ids": types, "labels": labels}
        if nsp:
            sample["next_sentence_label"] = gen.randrange(2)
        samples.append(sample)
    return samples


def padded_batch(samples):
    """The same samples right-padded for the stock model."""
    longest = max(len(s["input_ids"]) for s in samples)
    out = {
        "input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "token_type_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
        "labels": torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long),
    }
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][row, :n] = torch.tensor(s["input_ids"])
        out["token_type_ids"][row, :n] = torch.tensor(s["token_type_ids"])
        out["attention_mask"][row, :n] = 1
        out["labels"][row, :n] = torch.tensor(s["labels"])
    if "next_sentence_label" in samples[0]:
        out["next_sentence_label"] = torch.tensor([s["next_sentence_label"] for s in samples])
    return out


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(actual, expected, atol=1e-5, rtol=1e-4):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


# ---------------------------------------------------------------------------------------------------- collate


def test_pack_sequences_builds_padding_free_batch():
    samples = make_samples([3, 1, 4], nsp=True)
    batch = pack_sequences(samples)
    assert batch["input_ids"].tolist() == sum((s["input_ids"] for s in samples), [])
    assert batch["token_type_ids"].tolist() == sum((s["token_type_ids"] for s in samples), [])
    assert batch["position_ids"].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 3, 4, 8]
    assert batch["max_seqlen"] == 4 and batch["seq_lengths"] == (3, 1, 4)
    labels = sum((s["labels"] for s in samples), [])
    assert batch["labels"].tolist() == labels
    assert batch["masked_positions"].tolist() == [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert batch["next_sentence_label"].tolist() == [s["next_sentence_label"] for s in samples]
    assert sequence_lengths(batch["cu_seqlens"]) == (3, 1, 4)
    counts = token_counts(batch["seq_lengths"])
    assert counts["computed_tokens"] == counts["real_tokens"] == 8 and counts["attention_padding_tokens"] == 0
    assert counts["padded_tokens"] == 12 and counts["attention_scores"] == 9 + 1 + 16


def test_pack_then_mask_with_mlm_labels():
    batch = pack_sequences(
        [{"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 0]}, {"input_ids": [8, 9], "token_type_ids": [0, 1]}]
    )
    assert "labels" not in batch
    masked = batch["input_ids"].clone()
    masked[[1, 4]] = 3
    labels = torch.full_like(masked, IGNORE_INDEX)
    labels[[1, 4]] = batch["input_ids"][[1, 4]]
    out = with_mlm_labels(batch, masked, labels)
    assert out["masked_positions"].tolist() == [1, 4] and out["input_ids"].tolist() == [5, 3, 7, 8, 3]
    assert batch["input_ids"].tolist() == [5, 6, 7, 8, 9]  # the input batch is not modified
    with pytest.raises(ValueError, match="with_mlm_labels"):
        with_mlm_labels(batch, masked[:-1], labels[:-1])


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "no samples"),
        ([{"input_ids": [1, 2], "token_type_ids": [0]}], "unequal lengths"),
        ([{"input_ids": [], "token_type_ids": []}], "no tokens"),
        (
            [{"input_ids": [1], "token_type_ids": [0], "labels": [1]}, {"input_ids": [1], "token_type_ids": [0]}],
            "some samples have labels",
        ),
    ],
)
def test_pack_sequences_rejects_bad_samples(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(bad)


# ---------------------------------------------------------------------------------------------------- attention


def padded_reference_attention(query, key, value, lengths, dropout_p=0.0):
    """Pad to the longest sequence, one masked SDPA call, unpad."""
    longest, heads, dim = max(lengths), query.shape[1], query.shape[2]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def pad(x):
        out = x.new_zeros(len(lengths), longest, heads, dim)
        for row, (start, n) in enumerate(zip(starts, lengths)):
            out[row, :n] = x[start : start + n]
        return out.transpose(1, 2)

    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, longest)
    out = F.scaled_dot_product_attention(pad(query), pad(key), pad(value), attn_mask=mask).transpose(1, 2)
    return torch.cat([out[row, :n] for row, n in enumerate(lengths)])


def test_sdpa_loop_matches_padded_masked_attention_and_its_gradient():
    torch.manual_seed(0)
    lengths = [5, 1, 17, 9]
    q, k, v = (torch.randn(sum(lengths), 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    weights = torch.randn(sum(lengths), 4, 8, dtype=torch.float64)
    cu = torch.tensor([0, 5, 6, 23, 32], dtype=torch.int32)
    ours = packed_attention(q, k, v, cu, 17, lengths)
    ref = padded_reference_attention(q, k, v, lengths)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)
    ours_grads = torch.autograd.grad((ours * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("packed_bits", [False, True])
def test_attention_dropout_is_applied_and_unbiased(packed_bits):
    """Dropout on the attention probabilities (rescaled by the inverse keep rate: SDPA's, or the packed bits' of
    ``model.fused_dropout``) leaves the output's mean unchanged."""
    torch.manual_seed(0)
    lengths, draws, p = [3, 6], 4000, 0.5
    q, k, v = (torch.randn(sum(lengths), 2, 4, dtype=torch.float64) for _ in range(3))
    ref = sdpa_loop_attention(q, k, v, lengths)
    samples = [sdpa_loop_attention(q, k, v, lengths, dropout_p=p, packed_bits=packed_bits) for _ in range(draws)]
    samples = torch.stack(samples)
    assert (samples - ref).abs().amax() > 0.1  # dropout does something
    standard_error = samples.std(0) / draws**0.5
    assert ((samples.mean(0) - ref).abs() <= 6 * standard_error + 1e-9).all()


def test_varlen_backend_fails_loudly_where_unusable():
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="varlen flash attention is unusable"):
        packed_attention(q, q, q, cu, 4, [4], backend="varlen")
    with pytest.raises(ValueError, match="backend"):
        packed_attention(q, q, q, cu, 4, [4], backend="flex")
    torch.testing.assert_close(
        packed_attention(q, q, q, cu, 4, [4]), packed_attention(q, q, q, cu, 4, [4], backend="sdpa_loop")
    )


@pytest.mark.parametrize("with_dropout", [False, True])
def test_varlen_probe_falls_back_with_a_warning_and_keeps_the_rng(with_dropout):
    """Flash varlen has no CPU kernel: the probe (the code CUDA runs once) must catch that, warn, keep RNG state."""
    state = torch.random.get_rng_state()
    with pytest.warns(UserWarning, match="varlen flash attention unusable on cpu"):
        assert probe_varlen(torch.device("cpu"), torch.bfloat16, 16, with_dropout) is False
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.no_grad():  # and the gate refuses CPU / fp32 / odd head sizes without probing
        assert not varlen_usable(torch.device("cpu"), torch.bfloat16, 16, with_dropout)
    assert not varlen_usable(torch.device("cuda", 0), torch.float32, 64, with_dropout)
    assert not varlen_usable(torch.device("cuda", 0), torch.bfloat16, 12, with_dropout)


# ---------------------------------------------------------------------------------------------------- model parity


@pytest.mark.parametrize("cls", [BertForMaskedLM, BertForPreTraining])
def test_loss_logits_and_gradients_match_padded_hf_model(cls):
    nsp = cls is BertForPreTraining
    samples = make_samples(LENGTHS, seed=1, nsp=nsp)
    model = make_model(cls).eval()
    padded = padded_batch(samples)
    ref = model(**padded)
    ref.loss.backward()
    ref_grads = grads(model)
    model.zero_grad()

    packed = pack_sequences(samples)
    wrapper = UnpaddedBert(model).eval()
    out = wrapper(**packed)
    assert isinstance(out, PretrainOutput)
    out.loss.backward()

    ref_logits = ref.logits if not nsp else ref.prediction_logits
    selected = padded["labels"] != IGNORE_INDEX
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.mlm_logits, ref_logits[selected], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.mlm_labels, padded["labels"][selected])
    if nsp:
        torch.testing.assert_close(out.nsp_logits, ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model), ref_grads)


def test_host_side_arguments_are_optional():
    """Without seq_lengths / max_seqlen / masked_positions the forward recovers them (with syncs) identically."""
    model = make_model(BertForPreTraining).eval()
    packed = pack_sequences(make_samples(LENGTHS, nsp=True))
    wrapper = UnpaddedBert(model).eval()
    full = wrapper(**packed)
    bare = {k: v for k, v in packed.items() if k not in ("seq_lengths", "max_seqlen", "masked_positions")}
    minimal = wrapper(**bare)
    assert torch.equal(full.loss, minimal.loss) and torch.equal(full.mlm_logits, minimal.mlm_logits)


def test_forward_and_backward_make_no_python_level_host_syncs(monkeypatch):
    """With the collator's host-side arguments nothing calls item/tolist/bool/int/float/nonzero on a tensor
    (a CPU stand-in for CUDA's sync debug mode; C++-internal syncs are not seen here)."""
    model = make_model(BertForPreTraining, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1).train()
    packed = pack_sequences(make_samples(LENGTHS, nsp=True))
    wrapper = UnpaddedBert(model)

    def sync(*args, **kwargs):
        raise AssertionError("host sync in the forward/backward path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    monkeypatch.setattr(torch, "nonzero", sync)
    wrapper(**packed, loss_normalizer=torch.tensor(40.0), nsp_normalizer=12.0).loss.backward()
    with pytest.raises(AssertionError, match="host sync"):  # the guard sees the fallback's sync
        wrapper(**{k: v for k, v in packed.items() if k != "seq_lengths"})
    monkeypatch.undo()
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    assert model.cls.seq_relationship.weight.grad.abs().sum() > 0


def test_attention_dropout_runs_in_training():
    """Only attention dropout on: training losses vary per draw, are seed-reproducible, and eval is deterministic."""
    model = make_model(BertForMaskedLM, attention_probs_dropout_prob=0.3)
    packed = pack_sequences(make_samples(LENGTHS))
    wrapper = UnpaddedBert(model).train()
    torch.manual_seed(5)
    first = wrapper(**packed).loss
    second = wrapper(**packed).loss
    torch.manual_seed(5)
    again = wrapper(**packed).loss
    wrapper.eval()
    eval_loss = wrapper(**packed).loss
    assert not torch.equal(first, second) and torch.equal(first, again)
    assert not torch.equal(first, eval_loss) and torch.equal(eval_loss, wrapper(**packed).loss)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    samples = make_samples(LENGTHS)
    model = make_model(BertForMaskedLM, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    wrapper = UnpaddedBert(model).train()
    packed = pack_sequences(samples)
    torch.manual_seed(3)
    wrapper(**packed).loss.backward()
    plain = grads(model)
    model.zero_grad()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    calls = []
    model.bert.encoder.layer[1].intermediate.register_forward_hook(lambda *args: calls.append(1))
    torch.manual_seed(3)
    loss = wrapper(**packed).loss
    loss.backward()
    assert len(calls) == 2  # the layer ran again in the backward: it was checkpointed
    assert_grads_close(grads(model), plain, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- normalizer


def test_loss_normalizer_makes_dealing_irrelevant():
    """The same 6 sequences as 2 × 3 or (shuffled) 3 × 2 micro-batches: summed gradients equal the big batch's."""
    samples = make_samples(LENGTHS, seed=2, nsp=True)
    model = make_model(BertForPreTraining).eval()
    wrapper = UnpaddedBert(model).eval()
    masked_total = sum(label != IGNORE_INDEX for s in samples for label in s["labels"])

    wrapper(**pack_sequences(samples)).loss.backward()
    big_mean = grads(model)
    model.zero_grad()
    wrapper(
        **pack_sequences(samples), loss_normalizer=torch.tensor(float(masked_total)), nsp_normalizer=float(len(samples))
    ).loss.backward()
    big = grads(model)
    assert_grads_close(big, big_mean, atol=1e-6, rtol=1e-5)  # sum / global count == the big batch's mean

    def dealt(order, size, normalized=True):
        model.zero_grad()
        for start in range(0, len(order), size):
            micro = [samples[i] for i in order[start : start + size]]
            kwargs = {"loss_normalizer": float(masked_total), "nsp_normalizer": float(len(samples))}
            kwargs = kwargs if normalized else {}
            wrapper(**pack_sequences(micro), **kwargs).loss.backward()
        return grads(model)

    assert_grads_close(dealt([0, 1, 2, 3, 4, 5], 3), big)
    assert_grads_close(dealt([4, 0, 5, 2, 1, 3], 2), big)
    unnormalized = dealt([4, 0, 5, 2, 1, 3], 2, normalized=False)
    with pytest.raises(AssertionError):  # per-micro-batch means do not add up to the big batch's gradient
        assert_grads_close({k: v / 3 for k, v in unnormalized.items()}, big)


def test_state_dict_is_the_wrapped_models_and_round_trips(tmp_path):
    model = make_model(BertForMaskedLM)
    expected = model.state_dict()
    wrapper = UnpaddedBert(model)
    assert wrapper.model is model
    inner = wrapper.model.state_dict()
    assert list(inner) == list(expected)
    assert all(inner[k].data_ptr() == expected[k].data_ptr() and torch.equal(inner[k], expected[k]) for k in expected)
    assert list(wrapper.state_dict()) == [f"model.{k}" for k in expected]
    assert sum(p.numel() for p in wrapper.parameters()) == sum(p.numel() for p in model.parameters())

    wrapper.model.save_pretrained(tmp_path)
    loaded = BertForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager")
    reloaded = loaded.state_dict()
    assert list(reloaded) == list(expected)
    assert all(torch.equal(reloaded[k], expected[k]) for k in expected)
    packed = pack_sequences(make_samples(LENGTHS))
    torch.testing.assert_close(
        UnpaddedBert(loaded).eval()(**packed).loss, wrapper.eval()(**packed).loss, atol=0, rtol=0
    )


def test_rejects_unsupported_models():
    with pytest.raises(TypeError, match="masked-LM model of a known family"):
        UnpaddedBert(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="decoder"):
        UnpaddedBert(BertForMaskedLM(tiny_config(is_decoder=True)))
    with pytest.raises(ValueError, match="attention"):
        UnpaddedBert(make_model(BertForMaskedLM), attention="flex")


# ---------------------------------------------------------------------------------------------------- bf16


def test_bf16_autocast_forward_backward_close_to_fp32():
    samples = make_samples(LENGTHS[:4], seed=3, nsp=True)
    model = make_model(
        BertForPreTraining, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ).eval()
    wrapper = UnpaddedBert(model).eval()
    packed = pack_sequences(samples)
    fp32 = wrapper(**packed)
    fp32.loss.backward()
    fp32_grads = grads(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = wrapper(**packed)
    assert bf16.mlm_logits.dtype == torch.bfloat16 and bf16.loss.dtype == torch.float32
    bf16.loss.backward()
    bf16_grads = grads(model)
    torch.testing.assert_close(bf16.loss, fp32.loss, atol=0.05, rtol=0.02)
    flat32 = torch.cat([g.flatten() for g in fp32_grads.values()])
    flat16 = torch.cat([bf16_grads[k].float().flatten() for k in fp32_grads])
    assert torch.isfinite(flat16).all()
    assert F.cosine_similarity(flat16, flat32, dim=0) > 0.99
    assert (flat16 - flat32).norm() < 0.1 * flat32.norm()
