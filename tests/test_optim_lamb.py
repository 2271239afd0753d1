"""LAMB math against an independent float64 formula, per-layer trust ratio, groups, state; the fused CPU kernel and
the multi-tensor step against the foreach path; the multi-tensor step's op count; no host reads in the step."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from ds_bertopt.optim import lamb_kernel, param_groups
from ds_bertopt.optim.lamb import Fragment, Lamb, Layout, lamb_update, trust_ratios
from ds_bertopt.testing.measure import VIEW_OPS, torch_ops

SHAPES = [(7,), (3, 5), (4, 3, 2), (1,), (16, 9)]


class Reference:
    """LAMB written out per tensor in float64, straight from the paper / MLPerf's reference."""

    def __init__(
        self,
        params,
        *,
        lr,
        betas,
        eps,
        weight_decay,
        bias_correction,
        adapt=True,
        min_ratio=None,
        max_ratio=None,
        max_grad_norm=0.0,
    ):
        self.w = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.t = 0
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.bc, self.adapt, self.min_ratio, self.max_ratio = bias_correction, adapt, min_ratio, max_ratio
        self.max_grad_norm = max_grad_norm
        self.ratios = []

    def step(self, grads):
        self.t += 1
        grads = [g.double() for g in grads]
        if self.max_grad_norm > 0:
            total = sum(float((g * g).sum()) for g in grads) ** 0.5
            if total > self.max_grad_norm:
                grads = [g * (self.max_grad_norm / total) for g in grads]
        self.ratios = []
        for i, g in enumerate(grads):
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            m_hat = self.m[i] / (1 - self.b1**self.t) if self.bc else self.m[i]
            v_hat = self.v[i] / (1 - self.b2**self.t) if self.bc else self.v[i]
            update = m_hat / (v_hat.sqrt() + self.eps) + self.wd * self.w[i]
            w_norm, u_norm = float(self.w[i].norm()), float(update.norm())
            ratio = 1.0
            if self.adapt and w_norm > 0 and u_norm > 0:
                ratio = w_norm / u_norm
                if self.min_ratio is not None:
                    ratio = max(ratio, self.min_ratio)
                if self.max_ratio is not None:
                    ratio = min(ratio, self.max_ratio)
            self.ratios.append(ratio)
            self.w[i] = self.w[i] - self.lr * ratio * update


def _params(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, gen, scale=1.0):
    return [torch.randn(p.shape, generator=gen) * scale for p in params]


def _run_both(params, steps=4, grad_scale=1.0, kernel="auto", **kw):
    ours_kw = {k: v for k, v in kw.items() if k not in ("min_ratio", "max_ratio")}
    lamb = Lamb(
        params, min_trust_ratio=kw.get("min_ratio"), max_trust_ratio=kw.get("max_ratio"), kernel=kernel, **ours_kw
    )
    ref = Reference(params, **kw)
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        grads = _grads(params, gen, grad_scale)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        lamb.step()
        ref.step(grads)
    return lamb, ref


def _kernel_or_skip(kernel: str) -> str:
    if kernel == "fused" and lamb_kernel.library() is None:
        pytest.skip(f"no fused CPU kernel here: {lamb_kernel.unavailable_reason()}")
    return kernel


KERNELS = ["fused", "multi_tensor", "foreach"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_step_matches_formula_reference(weight_decay, bias_correction, kernel):
    params = _params()
    lamb, ref = _run_both(
        params,
        kernel=_kernel_or_skip(kernel),
        lr=0.02,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
    )
    for p, w in zip(params, ref.w):
        torch.testing.assert_close(p.detach().double(), w, rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(
        lamb.last_trust_ratios[0], torch.tensor(ref.ratios, dtype=torch.float64), rtol=1e-5, atol=0
    )


def test_trust_ratio_is_per_parameter():
    params = _params(1, [(6, 4), (5,)])
    before = [p.detach().clone() for p in params]
    lamb, ref = _run_both(
        params, steps=1, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True
    )
    # With the ratio ‖w‖/‖u‖ each layer moves by exactly lr·‖w‖, whatever its scale or gradient.
    for p, b in zip(params, before):
        assert float((p.detach() - b).norm() / b.norm()) == pytest.approx(0.01, rel=1e-5)
    assert ref.ratios[0] != pytest.approx(ref.ratios[1], rel=1e-2)

    # Scaling one layer by 1000 changes its own ratio and nothing about the other layer's step.
    scaled = _params(1, [(6, 4), (5,)])
    with torch.no_grad():
        scaled[0].mul_(1000.0)
    lamb2, _ = _run_both(
        scaled, steps=1, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True
    )
    torch.testing.assert_close(scaled[1].detach(), params[1].detach(), rtol=0, atol=0)
    # (bounded by 1/weight_decay once λw dominates the update)
    assert float(lamb2.last_trust_ratios[0][0]) > 50 * float(lamb.last_trust_ratios[0][0])


def test_zero_norm_layers_take_ratio_one():
    zero_weight = torch.nn.Parameter(torch.zeros(4))
    still = torch.nn.Parameter(torch.randn(3, 3))
    lamb = Lamb([zero_weight, still], lr=0.1, weight_decay=0.0)
    zero_weight.grad = torch.tensor([1.0, -2.0, 0.5, 0.0])
    still.grad = torch.zeros(3, 3)
    before = still.detach().clone()
    lamb.step()
    ratios = lamb.last_trust_ratios[0]
    assert ratios.tolist() == [1.0, 1.0]
    # First Adam step with bias correction moves each element by lr·sign(g) (ε aside).
    torch.testing.assert_close(zero_weight.detach(), torch.tensor([-0.1, 0.1, -0.1, 0.0]), rtol=0, atol=1e-6)
    assert torch.equal(still.detach(), before) and torch.isfinite(still).all()


def test_trust_ratio_function_handles_zeros_and_clamps():
    w_sq = torch.tensor([4.0, 0.0, 9.0, 1.0, 1e-8], dtype=torch.float64)
    u_sq = torch.tensor([1.0, 1.0, 0.0, 1e4, 1.0], dtype=torch.float64)
    assert trust_ratios(w_sq, u_sq).tolist() == pytest.approx([2.0, 1.0, 1.0, 0.01, 1e-4])
    clamped = trust_ratios(w_sq, u_sq, min_ratio=0.05, max_ratio=1.5)
    assert clamped.tolist() == pytest.approx([1.5, 1.0, 1.0, 0.05, 0.05])


@pytest.mark.parametrize("kernel", KERNELS)
def test_clamped_ratios_match_reference(kernel):
    params = _params(2)
    _, ref = _run_both(
        params,
        kernel=_kernel_or_skip(kernel),
        lr=0.05,
        betas=(0.9, 0.99),
        eps=1e-6,
        weight_decay=0.01,
        bias_correction=True,
        min_ratio=0.5,
        max_ratio=2.0,
    )
    assert any(r in (0.5, 2.0) for r in ref.ratios), "clamps never engaged: the test proves nothing"
    for p, w in zip(params, ref.w):
        torch.testing.assert_close(p.detach().double(), w, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("grad_scale", [0.01, 10.0])
def test_global_norm_clipping_matches_reference(grad_scale, kernel):
    params = _params(3)
    _, ref = _run_both(
        params,
        kernel=_kernel_or_skip(kernel),
        grad_scale=grad_scale,
        lr=0.02,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        bias_correction=True,
        max_grad_norm=1.0,
    )
    unclipped = _params(3)
    _run_both(
        unclipped, grad_scale=grad_scale, lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True
    )
    for p, w in zip(params, ref.w):
        torch.testing.assert_close(p.detach().double(), w, rtol=2e-6, atol=2e-7)
    moved_apart = any(not torch.allclose(a, b, rtol=1e-4) for a, b in zip(params, unclipped))
    assert moved_apart == (grad_scale > 1), "clipping should act exactly when the norm exceeds max_grad_norm"


def test_group_without_trust_ratio_takes_torch_adamw_steps():
    params = _params(4, [(5, 3), (8,)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lamb = Lamb([{"params": params, "weight_decay": 0.0, "adapt": False}], lr=0.003, eps=1e-6)
    adamw = torch.optim.AdamW(twins, lr=0.003, eps=1e-6, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        for p, t, g in zip(params, twins, _grads(params, gen)):
            p.grad, t.grad = g.clone(), g.clone()
        lamb.step()
        adamw.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fragment_layout_equals_whole_layers(kernel):
    """Layers split across two held tensors (as over two ranks' shards) step like whole layers."""
    _kernel_or_skip(kernel)
    shapes = [(5, 4), (9,), (3, 7)]
    whole = _params(6, shapes)
    flat = torch.cat([p.detach().reshape(-1) for p in whole])
    cut = 23  # inside the second layer
    shards = [flat[:cut].clone(), torch.cat([flat[cut:], torch.zeros(3)])]  # padding at the end
    fragments, offset = [], 0
    for layer, p in enumerate(whole):
        start, end = offset, offset + p.numel()
        if start < cut:
            fragments.append(Fragment(0, start, min(end, cut) - start, layer))
        if end > cut:
            fragments.append(Fragment(1, max(start, cut) - cut, end - max(start, cut), layer))
        offset = end
    layout = Layout(tuple(fragments), len(shapes))
    moments = [[torch.zeros_like(s) for s in shards] for _ in range(2)]
    lamb = Lamb(whole, lr=0.05, weight_decay=0.01, kernel=kernel)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 4):
        grads = _grads(whole, gen)
        for p, g in zip(whole, grads):
            p.grad = g
        lamb.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        shard_grads = [flat_grad[:cut], torch.cat([flat_grad[cut:], torch.zeros(3)])]
        lamb_update(
            shards,
            shard_grads,
            moments[0],
            moments[1],
            [step, step],
            lr=0.05,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            bias_correction=True,
            layout=layout,
            kernel=kernel,
        )
    torch.testing.assert_close(
        torch.cat([shards[0], shards[1][:-3]]), torch.cat([p.detach().reshape(-1) for p in whole]), rtol=1e-6, atol=1e-7
    )
    assert torch.equal(shards[1][-3:], torch.zeros(3)), "padding must not move"


def test_unattached_flat_shard_is_refused():
    params = _params(8, [(4, 4), (4,)])
    lamb = Lamb(params)
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    lamb.param_groups[0]["params"] = [flat]  # what ZeRO 1/2 do to a client optimizer
    flat.grad = torch.ones_like(flat)
    with pytest.raises(RuntimeError, match="attach_lamb"):
        lamb.step()


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(
        BertConfig(
            vocab_size=97,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )


def test_param_groups_exclude_biases_and_layernorm():
    model = _tiny_bert()
    groups = param_groups(model, 0.01, decay_extra={"adapt": True}, no_decay_extra={"adapt": False})
    names = {id(p): n for n, p in model.named_parameters()}
    decay = [names[id(p)] for p in groups[0]["params"]]
    no_decay = [names[id(p)] for p in groups[1]["params"]]
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert groups[0]["adapt"] and not groups[1]["adapt"]
    assert all(n.endswith(".weight") and "LayerNorm" not in n for n in decay)
    assert all(n.endswith(".bias") or "LayerNorm" in n for n in no_decay)
    assert any("LayerNorm.weight" in n for n in no_decay) and any(n.endswith("dense.bias") for n in no_decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_state_dict_resume_is_bit_exact():
    def make():
        params = _params(9)
        return params, Lamb(params, lr=0.01, max_grad_norm=1.0)

    gen = torch.Generator().manual_seed(11)
    grads = [_grads(_params(9), gen, 3.0) for _ in range(6)]
    straight, opt = make()
    for g in grads:
        for p, x in zip(straight, g):
            p.grad = x.clone()
        opt.step()
    first, opt = make()
    for g in grads[:3]:
        for p, x in zip(first, g):
            p.grad = x.clone()
        opt.step()
    saved = copy.deepcopy((opt.state_dict(), [p.detach().clone() for p in first]))
    resumed, opt = make()
    opt.load_state_dict(saved[0])
    with torch.no_grad():
        for p, w in zip(resumed, saved[1]):
            p.copy_(w)
    for g in grads[3:]:
        for p, x in zip(resumed, g):
            p.grad = x.clone()
        opt.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


# --- the fused CPU kernel ---------------------------------------------------------------------------------------


def _twin_runs(groups_of, steps=5, **kw):
    """The same LAMB on every kernel that runs here, over the same parameters and gradients; returns the optimizers
    by kernel."""
    runs = {}
    for kernel in [k for k in KERNELS if k != "fused" or lamb_kernel.library() is not None]:
        groups = groups_of()
        lamb = Lamb(groups, kernel=kernel, **kw)
        gen = torch.Generator().manual_seed(21)
        for _ in range(steps):
            for group in groups:
                for p in group["params"]:
                    p.grad = torch.randn(p.shape, generator=gen) * 3.0
            lamb.step()
        runs[kernel] = lamb
    return runs


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"bias_correction": False},
        {"max_grad_norm": 1.0},
        {"min_trust_ratio": 0.5, "max_trust_ratio": 2.0},
        {"adapt_no_decay": True},
    ],
    ids=["plain", "no-bias-correction", "clipped", "clamped", "nvlamb"],
)
def test_fused_kernel_equals_foreach(options):
    """Several steps, a decayed group with the trust ratio and a no-decay group (adapt per ``adapt_no_decay``):
    parameters, moments and ratios of the fused CPU kernel and of the multi-tensor step (torch's fused Adam kernel)
    equal the foreach path's in fp32. Tolerance rtol 2e-6, atol 1e-7: all round every step; the kernel computes
    u = λw + f·m/(√v + e) in the foreach path's order, but its sums are fp32
    blocks added in double (foreach: fp32 norms squared in double) and its moments b·m + (1−b)·g (foreach:
    lerp), so values differ by an ulp or two per step (observed ≤ 4.8e-7 on weights of magnitude ≤ 4; atol 1e-7
    also for the moments, where m cancels near 0 with terms of the gradients' size, 3). Without a C compiler the
    multi-tensor step is still compared."""
    adapt_no_decay = options.pop("adapt_no_decay", False)
    shapes = [(7,), (3, 5), (4, 3, 2), (1,), (16, 9), (130, 33), (0,)]

    def groups_of():
        params = _params(12, shapes)
        return [
            {"params": params[:5], "weight_decay": 0.01, "adapt": True},
            {"params": params[5:], "weight_decay": 0.0, "adapt": adapt_no_decay},
        ]

    runs = _twin_runs(groups_of, lr=0.02, **options)
    foreach = runs.pop("foreach")
    for fused in runs.values():
        for a, b in zip(
            [p for g in fused.param_groups for p in g["params"]],
            [p for g in foreach.param_groups for p in g["params"]],
        ):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(fused.state[a][key], foreach.state[b][key], rtol=2e-6, atol=1e-7)
        for r_fused, r_foreach in zip(fused.last_trust_ratios, foreach.last_trust_ratios):
            torch.testing.assert_close(r_fused, r_foreach, rtol=1e-5, atol=0)
        if "max_grad_norm" in options:
            assert float(fused.last_grad_scale) < 1.0
            torch.testing.assert_close(fused.last_grad_scale, foreach.last_grad_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("clamps", [(None, None), (0.9, 1.1)], ids=["free", "clamped"])
def test_fused_kernel_one_sweep_equals_two_passes(clamps):
    """A piece that is its whole layer, with nothing to all-reduce, is stepped inside the first pass with the C
    kernel's ratio (``scale_of``); with a stand-in all-reduce the same step takes two passes and ``trust_ratios``'
    ratio from torch. The same bits either way: free and clamped ratios (both clamps binding), a zero layer."""
    _kernel_or_skip("fused")
    results = []
    for allreduce in (None, lambda sums: None):
        params = [p.detach() for p in _params(31, [(33, 17), (5,), (64,)])]
        params[0].mul_(3.0)
        params[1].zero_()  # ‖w‖ = ‖u‖ = 0 (zero gradients too): ratio 1
        params[2].mul_(0.05)
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        gen = torch.Generator().manual_seed(8)
        for step in range(1, 4):
            grads = _grads(params, gen)
            grads[1].zero_()
            ratios = lamb_update(
                params,
                grads,
                *moments,
                [step] * 3,
                lr=0.05,
                beta1=0.9,
                beta2=0.999,
                eps=1e-6,
                weight_decay=0.01,
                bias_correction=True,
                min_trust_ratio=clamps[0],
                max_trust_ratio=clamps[1],
                allreduce=allreduce,
                kernel="fused",
            )
        results.append((params, ratios))
    (one, ratios), (two, ratios_two) = results
    assert torch.equal(ratios, ratios_two)
    if clamps[0] is not None:
        assert ratios.tolist() == [1.1, 1.0, 0.9]
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def _ops_and_host_reads(fn) -> tuple:
    """The torch ops ``fn`` calls (:func:`torch_ops`), and the top-level op above each read of a value on the host
    (``aten::item``, from the profiler). On CUDA the fused Adam kernel reads its step tensors on the device
    (``adam_math``'s ``*step_count``); the CPU kernel reads its CPU step tensor with ``item``."""
    with torch.profiler.profile() as prof:
        ops = torch_ops(fn)
    reads = []
    for event in prof.events():
        if event.name == "aten::item":
            while event.cpu_parent is not None:
                event = event.cpu_parent
            reads.append(event.name)
    return ops, reads


def test_multi_tensor_step_ops_per_group_are_few_and_counted():
    """The step LAMB takes on CUDA without apex (``multi_tensor``), profiled on the CPU where torch runs the same ops:
    per param group, clipped, with the trust ratio, the same ops for 3 tensors as for 30 (nothing per tensor in
    Python), four passes over the parameters (λw, torch's fused Adam kernel for the moments and the direction, the
    norms, the update), each a multi-tensor op whose lists match tensor for tensor (torch's fast path) but the update,
    whose per-layer scales are 0-d device tensors (on CUDA one kernel per tensor, together one pass); at most 22
    launching ops in all, the rest on per-layer vectors; nothing read on the host."""
    counts = []
    for n in (3, 30):
        params = [p.detach() for p in _params(5, [(16, 8), (8,), (3, 5)] * (n // 3))]
        gen = torch.Generator().manual_seed(2)
        grads = _grads(params, gen)
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        clip = torch.tensor(0.5)

        step = functools.partial(
            lamb_update,
            params,
            grads,
            *moments,
            [1] * n,
            lr=0.05,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            bias_correction=True,
            grad_scale=clip,
            kernel="multi_tensor",
        )
        ops, reads = _ops_and_host_reads(step)
        assert set(reads) <= {"aten::_fused_adam_"}, reads  # only the CPU kernel reads its CPU step tensor
        passes = [(name, lists) for name, lists in ops if name.startswith(("_foreach_", "_fused_"))]
        assert [name for name, _ in passes] == ["_foreach_mul", "_fused_adam_", "_foreach_norm", "_foreach_addcmul_"]
        shapes = [tuple(p.shape) for p in params]
        for name, lists in passes[:2]:  # every list shaped like the parameters (the step list: 0-d step tensors)
            assert all(shape == shapes for shape in lists if shape[0] != ()), (name, lists)
        assert passes[2][1] == [shapes + shapes]  # the norms of w and u, one op
        assert passes[3][1] == [shapes, shapes, [()] * n]  # the update: per-layer scales are 0-d device tensors
        counts.append([name for name, _ in ops if name not in VIEW_OPS])
    assert counts[0] == counts[1]
    assert len(counts[0]) <= 22, counts[0]  # 4 passes + 18 on per-layer vectors (torch 2.13); one launch each


def test_fused_kernel_split_over_threads_equals_one_thread(monkeypatch):
    """With several threads the fragments are cut into pieces (a layer across pieces and threads); the per-layer
    sums and the step are those of one thread."""
    _kernel_or_skip("fused")
    shapes = [(37, 29), (300,), (9, 8, 7)]
    fragments = [(0, 0, 1073, 0), (1, 0, 300, 1), (2, 0, 504, 2)]
    monkeypatch.setattr(lamb_kernel, "MIN_PER_THREAD", 64)
    split = lamb_kernel.plan(fragments, 3)
    assert len(split.bounds) == 4 and len(split.tensor) > 3, split.bounds
    covered = sorted(zip(split.tensor, split.offset, split.numel))
    assert sum(n for _, _, n in covered) == 1877 and covered[0][1] == 0  # the pieces tile the tensors
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(lamb_kernel, "threads", lambda threads=threads: threads)
        params = _params(13, shapes)
        lamb = Lamb(params, lr=0.05, kernel="fused")
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            lamb.step()
        results.append((torch.cat([p.detach().reshape(-1) for p in params]), lamb.last_trust_ratios[0]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=0)


def test_kernel_choice_and_fallback(monkeypatch):
    """auto: the kernel for contiguous fp32 CPU tensors, foreach for others (here a transposed weight) and when the
    kernel cannot be built; "fused" then refuses, naming why; a layout past a tensor's end is refused."""
    _kernel_or_skip("fused")
    strided = torch.nn.Parameter(torch.randn(6, 4).t())
    lamb = Lamb([strided], kernel="auto")
    strided.grad = torch.randn(4, 6)
    lamb.step()  # foreach: the kernel would read a strided tensor as if it were contiguous
    twin = torch.nn.Parameter(strided.detach().clone())
    twin.grad = strided.grad.clone()
    assert torch.isfinite(strided).all()
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU"):
        Lamb([strided], kernel="fused").step()
    with pytest.raises(RuntimeError, match="multi_tensor.*contiguous tensors of one device and dtype"):
        Lamb([strided], kernel="multi_tensor").step()
    with pytest.raises(ValueError, match="past|ends at element"):
        lamb_update(
            [torch.zeros(4)],
            [torch.ones(4)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [1],
            lr=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.0,
            bias_correction=True,
            layout=Layout((Fragment(0, 2, 3, 0),), 1),
            kernel="fused",
        )
    monkeypatch.setattr(lamb_kernel, "library", lambda: None)
    monkeypatch.setattr(lamb_kernel, "unavailable_reason", lambda: "no C compiler (test)")
    params = _params(14, [(3, 4)])
    params[0].grad = torch.ones(3, 4)
    before = params[0].detach().clone()
    Lamb(params, kernel="auto").step()
    assert not torch.equal(params[0].detach(), before)
    with pytest.raises(RuntimeError, match=r"unavailable \(no C compiler \(test\)\)"):
        Lamb(params, kernel="fused").step()
    with pytest.raises(ValueError, match="kernel"):
        Lamb(params, kernel="apex")


HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_reads_nothing_back_on_the_host(monkeypatch, kernel):
    """A CPU proxy for "no host sync": during steps with clipping, clamps and a split layer all-reduced (a stand-in
    reduction), no tensor value is read into Python (``item``/``tolist``/``float``/``bool``/… are counted). On CUDA
    these are exactly the calls that would wait for the device."""
    _kernel_or_skip(kernel)
    shapes = [(5, 4), (9,), (3, 7)]
    params = _params(15, shapes)
    groups = [{"params": params[:2]}, {"params": params[2:], "adapt": False, "weight_decay": 0.0}]
    lamb = Lamb(groups, lr=0.05, max_grad_norm=0.5, min_trust_ratio=0.1, max_trust_ratio=5.0, kernel=kernel)
    shards = [torch.randn(23), torch.randn(9)]
    layout = Layout((Fragment(0, 0, 20, 0), Fragment(0, 20, 3, 1), Fragment(1, 0, 6, 1)), 2)
    moments = [[torch.zeros_like(t) for t in shards] for _ in range(2)]
    reduced = []
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        lamb.step()
        lamb_update(
            shards,
            [torch.randn(t.shape, generator=gen) for t in shards],
            *moments,
            [step, step],
            lr=0.05,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            bias_correction=True,
            grad_scale=torch.tensor(0.5),
            layout=layout,
            allreduce=reduced.append,
            kernel=kernel,
        )
    monkeypatch.undo()
    assert reads == [], f"the step read tensor values on the host: {sorted(set(reads))}"
    assert isinstance(lamb.last_grad_scale, torch.Tensor) and float(lamb.last_grad_scale) < 1.0  # clipping acted
    assert len(reduced) == 3 and reduced[0].shape == (2, 2)


@pytest.mark.precision
def test_multi_tensor_step_on_bf16_parameters_matches_foreach():
    """bf16 parameters (the multi-tensor step takes them on CUDA): the same step as the foreach path, to bf16's
    resolution, and a step that moves the weights."""
    torch.manual_seed(0)
    start = [torch.randn(6, 4).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)]
    grads = [[torch.randn_like(p, dtype=torch.float32).to(torch.bfloat16) for p in start] for _ in range(3)]
    runs = {}
    for kernel in ("multi_tensor", "foreach"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        lamb = Lamb(params, lr=0.01, weight_decay=0.01, kernel=kernel)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            lamb.step()
        runs[kernel] = [p.detach().float() for p in params]
    for a, b, s in zip(runs["multi_tensor"], runs["foreach"], start):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)
        assert not torch.equal(a, s.float())
