"""CPU forward + backward time of exact attention forms for a packed micro-batch: the design choice in
ds_bertopt/model/unpadded.py.

Candidates, all exact: (a) length-bucketed SDPA (sequences sorted by length, contiguous groups chosen by a dynamic
programme minimising ``groups × overhead + Σ n·L_max²``, each padded to its own longest with a key mask), (b) one SDPA
call with a block-diagonal mask over the packed row, (c) the per-sequence SDPA loop (``unpadded.sdpa_loop_attention``),
and (d) everything padded to the longest (the padded model). Medians of a few interleaved repeats (indicative).
``--model``: the whole model, UnpaddedBert vs the stock padded BertForMaskedLM, 16 sequences of 20..512 tokens.

    OMP_NUM_THREADS=1 python bench/unpadded_attention.py [--model]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._common import bert_sizes, interleaved, median, padded_batch
from ds_bertopt.data.collate import pack_sequences
from ds_bertopt.model.unpadded import UnpaddedBert, sdpa_loop_attention, token_counts


def _sdpa(q, k, v, p, mask=None):  # [n, L, heads, dim] in and out
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p).transpose(1, 2)


def bucket_groups(lengths, overhead):
    """Contiguous groups of the (descending) sorted lengths minimising ``overhead·groups + Σ n·L_max²``."""
    n = len(lengths)
    best, cut = [0.0] * (n + 1), [0] * (n + 1)
    for j in range(1, n + 1):  # the cheapest last group lengths[i:j], the first such i on a tie
        best[j], cut[j] = min((best[i] + overhead + (j - i) * lengths[i] ** 2, i) for i in range(j))
    groups, j = [], n
    while j:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def bucketed(lengths, groups):
    """(a): pad each group to its own longest (``pad_sequence`` on ``split`` views), key-padding mask."""
    masks = {
        a: (torch.arange(lengths[a]) < torch.tensor(lengths[a:b])[:, None]).view(b - a, 1, 1, lengths[a])
        for a, b in groups
        if lengths[b - 1] != lengths[a]
    }

    def attend(q, k, v, p):
        splits, outs = [x.split(lengths) for x in (q, k, v)], []
        for a, b in groups:
            padded = (torch.nn.utils.rnn.pad_sequence(xs[a:b], batch_first=True) for xs in splits)
            out = _sdpa(*padded, p, masks.get(a))
            outs.extend(out[r, : lengths[a + r]] for r in range(b - a))
        return torch.cat(outs)

    return attend


def timed(loss, *inputs, model=None):
    """A variant for :func:`interleaved`: ``loss(*inputs)`` and its backward, from fresh leaves (and ``model``'s
    gradients dropped), timed without those copies."""

    def run() -> float:
        leaves = [t.clone().requires_grad_() for t in inputs]
        if model is not None:
            model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss(*leaves).backward()
        return time.perf_counter() - start

    return run


def main(reps: int = 5) -> None:
    torch.manual_seed(0)
    heads, dim = 4, 64  # hidden 256
    for count, low, high in [(16, 20, 512), (64, 16, 128)]:
        lengths = sorted(np.random.default_rng(0).integers(low, high + 1, count).tolist(), reverse=True)
        total, padded = sum(lengths), token_counts(lengths)["padded_tokens"]
        q0, k0, v0, weight = (torch.randn(total, heads, dim) for _ in range(4))
        reference = sdpa_loop_attention(q0, k0, v0, lengths)
        share = f"{padded} ({1 - total / padded:.0%} of them padding)"
        print(f"{count} sequences, lengths {low}..{high}: {total} real tokens; padded to the longest {share}")
        loop = lambda q, k, v, p, lengths=lengths: sdpa_loop_attention(q, k, v, lengths, dropout_p=p)
        candidates = {"(c) per-sequence SDPA loop": loop}
        for overhead in (2_000, 20_000):
            groups = bucket_groups(lengths, overhead)
            pad = sum((b - a) * lengths[a] for a, b in groups) / total - 1
            candidates[f"(a) bucketed, {len(groups)} groups, {pad:.1%} pad"] = bucketed(lengths, groups)
        seq = torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))
        mask = seq[:, None] == seq[None, :]  # (b): one SDPA over the packed row, only same-sequence pairs
        block = lambda q, k, v, p, m=mask: _sdpa(q[None], k[None], v[None], p, m)[0]
        candidates["(b) block-diagonal mask, 1 call"] = block
        candidates["(d) padded to longest, 1 call"] = bucketed(lengths, [(0, count)])
        variants = {
            (name, p): timed(lambda q, k, v, f=attend, p=p, w=weight: (f(q, k, v, p) * w).sum(), q0, k0, v0)
            for name, attend in candidates.items()
            for p in (0.0, 0.1)
        }
        times = interleaved(variants, repeats=reps, warmup=1)
        for name, attend in candidates.items():
            error = (attend(q0, k0, v0, 0.0) - reference).abs().max().item()
            cells = [f"dropout {p:g}: {median(times[name, p]) * 1e3:7.1f} ms" for p in (0.0, 0.1)]
            print(f"  {name:38s} fwd+bwd  {cells[0]}   {cells[1]}   max |diff| {error:.1e}")


def bench_model(reps: int = 3) -> None:
    """Whole model, training mode (dropout 0.1): UnpaddedBert on the packed batch vs the padded encoder with
    the sparse MLM head (``SparseMLMHead``'s math) and the stock padded model (dense head)."""
    torch.manual_seed(0)
    sizes = bert_sizes(256, 4, 4, 1024, vocab_size=8192, max_position_embeddings=512)
    model = BertForMaskedLM(BertConfig(**sizes, attn_implementation="sdpa")).train()
    rng = np.random.default_rng(1)
    samples = []
    for n in rng.integers(20, 513, 16).tolist():
        labels = np.where(rng.random(n) < 0.15, rng.integers(0, 8192, n), -100).tolist()
        samples.append(dict(input_ids=rng.integers(5, 8192, n).tolist(), token_type_ids=[0] * n, labels=labels))
    packed, padded = pack_sequences(samples), padded_batch(samples)
    wrapper = UnpaddedBert(model)

    def padded_sparse_head():  # the padded encoder, the head at the masked positions only
        hidden = model.bert(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).last_hidden_state
        selected = padded["labels"] != -100
        return F.cross_entropy(model.cls(hidden[selected]), padded["labels"][selected])

    steps = {
        "UnpaddedBert, packed": lambda: wrapper(**packed).loss,
        "padded + sparse MLM head": padded_sparse_head,
        "BertForMaskedLM, padded (sdpa)": lambda: model(**padded).loss,
    }
    times = interleaved({name: timed(step, model=model) for name, step in steps.items()}, repeats=reps, warmup=1)
    for name, runs in times.items():
        print(f"  {name:32s} fwd+bwd {median(runs) * 1e3:7.0f} ms")


if __name__ == "__main__":
    bench_model() if "--model" in sys.argv else main()
