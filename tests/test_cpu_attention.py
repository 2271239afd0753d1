"""Attention with packed-bits dropout on the CPU (``ds_bertopt.model.cpu_attention``, ``model.fused_dropout``): the
dropped pairs are the packed bits' mask, the gradients are exact, the output is unbiased, the compiled op draws what
eager draws, bf16 follows fp32, and the profiler's step split counts it as attention."""

from __future__ import annotations

import pytest
import torch

from ds_bertopt.model import cpu_attention, fused
from ds_bertopt.model.unpadded import sdpa_loop_attention
from ds_bertopt.testing.step_split import split_step

LENGTHS = [3, 6, 1, 5]


def reference(query, key, value, lengths, p, window, keep):
    """Attention by plain autograd ops, dropping where ``keep`` (flat, sequence by sequence) is False."""
    outs, offset = [], 0
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
        n, heads, dim = q.shape
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        if window is not None:
            scores = scores.masked_fill(~cpu_attention.band_mask(n, window, q.device), float("-inf"))
        kept = keep[offset : offset + heads * n * n].view(heads, n, n)
        probs = torch.where(kept, scores.softmax(-1), 0) * fused.keep_scale(p)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        offset += heads * n * n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1])
def test_packed_bits_attention_drops_the_mask_it_draws_and_its_gradients_are_exact(window):
    torch.manual_seed(0)
    p = 0.3
    q, k, v = (torch.randn(sum(LENGTHS), 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(sum(LENGTHS), 2, 4, dtype=torch.float64)
    count = 2 * sum(n * n for n in LENGTHS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        keep = fused.keep_mask((count,), p)
    assert 0 < (~keep).sum() < count  # some pairs dropped, not all
    want = reference(q, k, v, LENGTHS, p, window, keep)
    torch.manual_seed(5)
    got = sdpa_loop_attention(q, k, v, LENGTHS, dropout_p=p, window=window, packed_bits=True)
    torch.testing.assert_close(got, want)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(ours, theirs)

    def reseeded(*qkv):
        torch.manual_seed(5)
        return sdpa_loop_attention(*qkv, LENGTHS, dropout_p=p, window=window, packed_bits=True)

    assert torch.autograd.gradcheck(reseeded, (q, k, v), fast_mode=True)


@pytest.mark.precision
def test_packed_bits_attention_in_bf16_follows_fp32():
    """bf16 inputs compute in fp32 inside (as SDPA's CPU math path does) and return bf16: the same mask under one
    seed, output and gradients within bf16 rounding of the fp32 run."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 2, 8) for _ in range(3))
    grad = torch.randn(sum(LENGTHS), 2, 8)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        torch.manual_seed(3)
        out = sdpa_loop_attention(*inputs, LENGTHS, dropout_p=0.2, packed_bits=True)
        assert out.dtype == dtype
        grads = torch.autograd.grad(out, inputs, grad.to(dtype))
        assert all(g.dtype == dtype for g in grads)
        results.append([out.float(), *(g.float() for g in grads)])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=0.06, rtol=0.02)


def test_the_step_split_counts_packed_bits_attention_as_attention():
    """Its matrix multiplies run inside :data:`~ds_bertopt.model.cpu_attention.PROFILE_NAME`: the profiler split
    puts them, forward and backward, under attention, not GEMMs; a linear beside it stays a GEMM."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 2, 8, requires_grad=True) for _ in range(3))
    weight = torch.randn(16, 16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = sdpa_loop_attention(q, k, v, LENGTHS, dropout_p=0.2, packed_bits=True)
        (out.reshape(-1, 16) @ weight).sum().backward()
    names = {event.name for event in prof.events()}
    assert cpu_attention.PROFILE_NAME in names
    split = split_step(prof.events())
    attention_only = split_step([e for e in prof.events() if e.name != "aten::mm"])  # the linear's mm left out
    assert split["attention"] > 0 and split["gemm"] > 0
    assert attention_only["gemm"] == 0  # every bmm of the attention, forward and backward, counted as attention
