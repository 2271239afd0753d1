"""The tied word embedding's sparse gradient (``model/tied.py``): the MLM wrappers' gradients equal the stock dense
embedding's, ``.grad`` stays dense (micro-batches accumulated, none masked, bf16 autocast), the backward no longer
zero-fills a vocabulary-sized tensor, and untied or replaced embeddings are left alone. Every family's parity with
the stock padded model, through the same wrappers, is in ``test_families.py``."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch.profiler import profile
from transformers import BertConfig, BertForMaskedLM

from ds_bertopt.data.collate import pack_sequences
from ds_bertopt.labels import IGNORE_INDEX
from ds_bertopt.model.bert import SparseMLMHead
from ds_bertopt.model.tied import SparseGradEmbedding, tie_sparse
from ds_bertopt.model.unpadded import UnpaddedMLM
from test_families import padded

VOCAB, HIDDEN = 997, 24


def model(tie: bool = True) -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tie,
    )  # fmt: skip
    return BertForMaskedLM(config)


def samples(seed: int, masked: bool = True) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in (9, 4, 13):
        ids = [rng.randrange(5, VOCAB) for _ in range(n)]
        labels = [rng.randrange(VOCAB) if masked and rng.random() < 0.3 else IGNORE_INDEX for _ in range(n)]
        out.append({"input_ids": ids, "token_type_ids": [0] * n, "labels": labels})
    return out


def wrapped(kind: str, tie_sparse_grad: bool):
    """``kind``'s wrapper around a fresh tiny BERT; ``tie_sparse_grad=False`` puts the stock embedding back (its
    dense backward, the reference)."""
    wrapper = (UnpaddedMLM if kind == "unpadded" else SparseMLMHead)(model())
    if not tie_sparse_grad:
        wrapper.model.get_input_embeddings().__class__ = torch.nn.Embedding
    return wrapper


def step(wrapper, kind: str, batches: list[list[dict]], autocast: bool = False) -> dict:
    """Forward + backward of each micro-batch in turn, ``.grad`` accumulated; the gradients, by name."""
    for batch in batches:
        inputs = pack_sequences(batch) if kind == "unpadded" else {**padded(batch), "token_type_ids": None}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            wrapper(**inputs).loss.backward()
    return {name: p.grad for name, p in wrapper.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["unpadded", "padded"])
def test_gradients_equal_the_dense_embedding_backward_and_stay_dense(kind):
    micro_batches = [samples(0), samples(1, masked=False), samples(2)]  # one without a masked token
    ours_wrapper = wrapped(kind, True)
    assert ours_wrapper.tied == f"tied embedding ({VOCAB}, {HIDDEN}): sparse gradient rows"
    ours = step(ours_wrapper, kind, micro_batches)
    reference = step(wrapped(kind, False), kind, micro_batches)
    assert ours.keys() == reference.keys() and "bert.embeddings.word_embeddings.weight" in ours
    for name, grad in ours.items():
        assert grad.layout == torch.strided and grad.is_contiguous(), name
        torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=1e-5, msg=lambda m, k=name: f"{k}: {m}")


def test_a_micro_batch_without_masked_tokens_gives_a_dense_gradient():
    """The head runs on the empty selection, so its (zero) dense gradient still meets the embedding's rows."""
    grads = step(wrapped("unpadded", True), "unpadded", [samples(3, masked=False)])
    embedding = grads["bert.embeddings.word_embeddings.weight"]
    assert embedding.layout == torch.strided and embedding.shape == (VOCAB, HIDDEN) and not embedding.any()


def test_bf16_autocast_gradients_stay_dense_and_close():
    ours = step(wrapped("unpadded", True), "unpadded", [samples(4)], autocast=True)
    reference = step(wrapped("unpadded", False), "unpadded", [samples(4)], autocast=True)
    for name, grad in ours.items():
        assert grad.layout == torch.strided and grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, reference[name], atol=1e-2, rtol=1e-2, msg=lambda m, k=name: f"{k}: {m}")


def vocab_sized_fills(wrapper) -> int:
    inputs = pack_sequences(samples(5))
    with profile(record_shapes=True) as prof:
        wrapper(**inputs).loss.backward()
    return sum(
        e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in ("aten::fill_", "aten::zero_") and e.input_shapes and e.input_shapes[0] == [VOCAB, HIDDEN]
    )


def test_the_backward_no_longer_zero_fills_a_vocabulary_sized_tensor():
    assert vocab_sized_fills(wrapped("unpadded", False)) >= 1  # the stock embedding backward does
    assert vocab_sized_fills(wrapped("unpadded", True)) == 0


def test_untied_or_replaced_embeddings_are_left_alone():
    untied = model(tie=False)
    assert tie_sparse(untied) is None and UnpaddedMLM(untied).tied is None
    assert type(untied.get_input_embeddings()) is torch.nn.Embedding

    class Scaled(torch.nn.Embedding):  # a replaced embedding (an adapter's, the memory kit's) is not ours to change
        pass

    replaced = model()
    old = replaced.get_input_embeddings()
    replaced.set_input_embeddings(Scaled(VOCAB, HIDDEN, _weight=old.weight))
    assert tie_sparse(replaced) is None and type(replaced.get_input_embeddings()) is Scaled
    tied = copy.deepcopy(model())
    assert tie_sparse(tied) is not None and tie_sparse(tied) is not None  # twice: idempotent
    assert isinstance(tied.get_input_embeddings(), SparseGradEmbedding) and not tied.get_input_embeddings().sparse


def test_outside_the_wrappers_the_same_model_gets_dense_gradients():
    """The wrapped model's base model alone (no decoder in the graph) keeps the stock dense embedding gradient."""
    wrapper = wrapped("unpadded", True)
    inputs = padded(samples(6))
    wrapper.model.bert(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
    ).last_hidden_state.sum().backward()
    grad = wrapper.model.get_input_embeddings().weight.grad
    assert grad.layout == torch.strided and grad.any()
    assert not wrapper.model.get_input_embeddings().rows_only  # the wrappers' forward leaves it off


def test_under_torch_compile_the_lookup_stays_dense():
    """Inductor cannot take a sparse gradient: a compiled function over the tied pair runs and matches eager."""
    tied = model()
    tie_sparse(tied)
    embedding, decoder = tied.get_input_embeddings(), tied.get_output_embeddings()
    embedding.rows_only = True  # as inside sparse_rows
    ids = torch.tensor([5, 9, 9, 300, 7])

    def loss(ids):
        return decoder(embedding(ids)[:3]).logsumexp(-1).sum()

    torch.compile(loss, backend="inductor")(ids).backward()
    compiled, embedding.weight.grad = embedding.weight.grad, None
    loss(ids).backward()
    assert compiled.layout == torch.strided
    torch.testing.assert_close(compiled, embedding.weight.grad)
