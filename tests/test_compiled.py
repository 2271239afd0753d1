"""``model.compile`` (ds_bertopt.model.compiled): compiled layers equal eager (fp32 loss and every gradient; bf16 to its
resolution), one graph per layer kind and no graph break for any mix of packed lengths, the attention op's backward
replaying its dropout, state dict and DeepSpeed checkpoints unchanged, and the config switch."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
import torch._dynamo

from ds_bertopt.config import BertOptConfig, RunConfig, dead_keys
from ds_bertopt.data.collate import pack_sequences
from ds_bertopt.model import compiled
from ds_bertopt.model.config import ModelConfig
from ds_bertopt.model.unpadded import UnpaddedMLM, sdpa_loop_attention
from ds_bertopt.testing.distributed import spawn_ranks
from _launch import FULL_MATRIX
from test_fused import tiny_bert

MIXES = ([5, 9, 3], [7, 12, 4], [20, 3, 6], [11, 11, 11])
"""Packed micro-batches of three sequences (our samplers' contract: equally many per micro-batch), four lengths."""


def packed(lengths, seed: int) -> dict:
    rng = random.Random(seed)
    samples = []
    for n in lengths:
        ids = [rng.randrange(5, 90) for _ in range(n)]
        labels = [t if i % 3 == 1 else -100 for i, t in enumerate(ids)]
        samples.append({"input_ids": ids, "token_type_ids": [0] * n, "labels": labels})
    return pack_sequences(samples)


@pytest.fixture
def dynamo_counters():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def graphs_and_breaks(counters) -> tuple[int, dict]:
    return int(counters["stats"]["unique_graphs"]), dict(counters["graph_break"])


def test_max_seqlen_bucket_is_the_power_of_two_ladder():
    assert [compiled.max_seqlen_bucket(n) for n in (1, 8, 9, 64, 65, 128, 129, 512)] == [
        8,
        8,
        16,
        64,
        128,
        128,
        256,
        512,
    ]
    lengths = range(1, 513)
    assert all(n <= compiled.max_seqlen_bucket(n) < max(16, 2 * n) for n in lengths)
    assert len({compiled.max_seqlen_bucket(n) for n in lengths}) == 7  # 8 … 512: a new graph at most per rung


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.precision)], ids=["fp32", "bf16"]
)
def test_compiled_equals_eager_in_two_graphs_without_a_break(dtype, dynamo_counters):
    """Inductor-compiled layers against the same model eager, on four packed lengths: the loss and every gradient
    (fp32: to fp32 rounding; bf16 autocast: to bf16's), two graphs in all (static, then the length dynamic), no
    break, and the same state dict keys."""
    eager, compiled_model = UnpaddedMLM(tiny_bert(0.0)).train(), UnpaddedMLM(tiny_bert(0.0), compile=True).train()
    assert compiled_model.compiled and "BertLayer" in compiled_model.choose_attention()
    assert list(compiled_model.state_dict()) == list(eager.state_dict())
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for seed, lengths in enumerate(MIXES if dtype == torch.float32 else MIXES[:2]):
        batch, losses = packed(lengths, seed), []
        for model in (eager, compiled_model):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                losses.append(model(**batch).loss)
            losses[-1].backward()
        torch.testing.assert_close(losses[1], losses[0], **tol)
        grads = dict(eager.named_parameters())
        for name, param in compiled_model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, **tol, msg=name)
    graphs, breaks = graphs_and_breaks(dynamo_counters)
    assert graphs <= 2 and not breaks, (graphs, breaks)


def test_every_packed_length_and_dropout_stay_in_two_graphs(dynamo_counters):
    """Twelve micro-batches of random lengths (2 to 60 tokens a sequence, so max_seqlen changes too), dropout on,
    fused dropout on: still two graphs per layer kind, no break (Dynamo's graphs; the eager backend is enough)."""
    model = UnpaddedMLM(tiny_bert(dropout=0.1), fused_dropout=True).train()
    compiled.compile_layers(model.hf, backend="eager")
    rng = random.Random(0)
    for seed in range(12):
        model(**packed([rng.randint(2, 60) for _ in range(3)], seed)).loss.backward()
    graphs, breaks = graphs_and_breaks(dynamo_counters)
    assert graphs <= 2 and not breaks, (graphs, breaks)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.precision)])
def test_compiled_fused_dropout_draws_what_eager_draws(dynamo_counters, dtype):
    """Under Inductor the packed-bits mask is one op drawing from the default generator (``fused.packed_keep_mask_op``):
    dropout + residual add + LayerNorm, forward and backward, equal eager under the same seed (the same bits; bf16 to
    its rounding, Inductor computing inside in fp32), over two shapes (the second one dynamic), with no graph break;
    a second draw differs from the first."""
    from ds_bertopt.model import fused

    norm = torch.nn.LayerNorm(24, dtype=dtype)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)

    def block(x, residual):
        return norm(fused.dropout_add(x, residual, 0.1))

    compiled_block = torch.compile(block, backend="inductor", fullgraph=True)
    for seed, rows in ((0, 37), (1, 53)):
        weight, results = torch.randn(rows, 24, generator=torch.Generator().manual_seed(seed)).to(dtype), []
        for fn in (block, compiled_block):
            x, residual = (torch.randn(rows, 24, generator=torch.Generator().manual_seed(rows + i)) for i in (0, 1))
            x, residual = x.to(dtype).requires_grad_(True), residual.to(dtype)
            torch.manual_seed(seed)
            out = fn(x, residual)
            (out * weight).sum().backward()  # not out.square(): LayerNorm makes that flat in x
            results.append((out.detach(), x.grad))
        (want, want_grad), (got, got_grad) = results
        assert got.dtype == want.dtype == got_grad.dtype == dtype
        torch.testing.assert_close(got, want, **tolerance)
        torch.testing.assert_close(got_grad, want_grad, **tolerance)
        assert torch.equal(got_grad == 0, want_grad == 0) and 0.03 < (want_grad == 0).float().mean() < 0.2
    torch.manual_seed(0)
    first = compiled_block(x, residual)
    assert not torch.equal(first, compiled_block(x, residual))  # the generator moved on
    assert not graphs_and_breaks(dynamo_counters)[1]


@pytest.mark.parametrize("packed_bits", [False, True])
def test_the_attention_op_backward_replays_its_dropout(packed_bits):
    """The op's forward and gradients (from the probabilities and keep-mask its forward kept) equal autograd through
    the eager SDPA loop run from the same seed (its attention-dropout mask: SDPA's ``bernoulli_`` draws, or the packed
    bits of ``model.fused_dropout``), compiled too (Inductor, the kept size dynamic over two length mixes); a different
    seed drops differently."""
    torch.manual_seed(0)
    grad = torch.randn(26, 2, 8)
    compiled_op = torch.compile(compiled.packed_attention_op, backend="inductor", fullgraph=True)

    def op(lengths, seed, call=compiled.packed_attention_op):
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        scores = torch.empty(()).expand(sum(n * n for n in lengths))
        qkv = (x[: sum(lengths)] for x in (q, k, v))
        return call(*qkv, cu, torch.tensor(seed), scores, 0, 0.3, None, -1, "sdpa_loop", packed_bits)

    q, k, v = (torch.randn(26, 2, 8, requires_grad=True) for _ in range(3))
    for lengths in ([5, 7, 3], [9, 2, 15]):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            ref = sdpa_loop_attention(
                *(x[: sum(lengths)] for x in (q, k, v)), lengths, dropout_p=0.3, packed_bits=packed_bits
            )
        want = torch.autograd.grad(ref, (q, k, v), grad[: sum(lengths)])
        for call in (compiled.packed_attention_op, compiled_op):
            out = op(lengths, 7, call)[0]
            torch.testing.assert_close(out, ref)
            for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad[: sum(lengths)]), want):
                torch.testing.assert_close(got, expected)
    assert not torch.equal(op(lengths, 8)[0], out)


def _checkpoint_rank(rank: int, world_size: int, root: str, stage: int) -> dict:
    """One DeepSpeed engine per setting (eager, compiled) at ZeRO ``stage``: a step, a checkpoint; then the compiled
    engine resumes from the eager one's checkpoint and takes the step the eager one takes."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    batch, out = packed(MIXES[0], 0), {}
    for name, compile_layers in (("eager", False), ("compiled", True)):
        model = UnpaddedMLM(tiny_bert(0.0), compile=compile_layers).train()
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.backward(engine(**batch).loss)
        engine.step()
        engine.save_checkpoint(f"{root}/{name}", tag="t")
        (path,) = Path(root, name, "t").glob("*mp_rank_00_model_states.pt")  # ZeRO-3: zero_pp_rank_0_mp_rank_00_…
        states = torch.load(path, weights_only=False)
        out[name] = {"keys": sorted(states["module"]), "engine": engine}
    out["compiled"]["engine"].load_checkpoint(f"{root}/eager", tag="t")
    losses = {name: float(out[name].pop("engine")(**batch).loss) for name in ("eager", "compiled")}
    return {**out, "losses": losses}


@pytest.mark.parametrize("stage", [0, 1, 2, 3] if FULL_MATRIX else [3])  # ZeRO 0-2: make test-matrix
def test_checkpoints_keep_their_keys_and_resume_across_compile(tmp_path, stage):
    (result,) = spawn_ranks(_checkpoint_rank, 1, str(tmp_path), stage, timeout=200)
    assert result["compiled"]["keys"] == result["eager"]["keys"] and result["eager"]["keys"]
    assert not any("_orig_mod" in key for key in result["compiled"]["keys"])
    assert result["losses"]["compiled"] == pytest.approx(result["losses"]["eager"], rel=1e-5)


def test_the_switch_is_validated_and_dead_unless_unpadded():
    assert "compile" in ModelConfig(unpadded=False).dead_fields()
    assert "compile" not in ModelConfig(unpadded=True, compile=True).dead_fields()
    run = RunConfig(path="", deepspeed={}, bertopt=BertOptConfig(model=ModelConfig(unpadded=False)))
    assert "model.compile" in dead_keys(run)
    with pytest.raises(Exception, match="compile: must be true or false"):
        ModelConfig(compile="yes")
