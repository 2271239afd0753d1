"""LAMB (You et al., 2019): Adam directions scaled per layer by the trust ratio ‖w‖ / ‖update‖.

The math is a set of pure functions over lists of tensors (vectorised with ``torch._foreach_*``):

* :func:`adam_directions` — advance the moments, return ``u = m̂/(√v̂ + ε) + λw`` per tensor;
* :func:`layer_sq_norms` — ``Σw²`` and ``Σu²`` per *layer* from the fragments that hold it;
* :func:`trust_ratios` — ``‖w‖/‖u‖`` per layer, 1 where either norm is 0, optionally clamped;
* :func:`lamb_update` — the whole step, with an optional ``allreduce`` of the per-layer sums.

Three implementations of the same step (``kernel``): on contiguous fp32 CPU tensors ``"fused"`` runs
:mod:`.lamb_kernel`'s two passes over memory (moments + per-piece sums, then the scaled update; one for a layer
whose state stays in cache); on CUDA (and wherever torch has a fused Adam kernel) ``"multi_tensor"`` takes the
moments and the direction in one kernel (:mod:`.lamb_multi`), then the norms and the update, four passes in all;
``"foreach"`` (any device and dtype) runs the ``torch._foreach_*`` functions below, nine. ``"auto"`` picks the first
that applies. None reads a value back on the host: the clip factor and the ratios stay tensors.

A *layer* is one model parameter. Normally each tensor the optimizer holds is a whole layer. Under
DeepSpeed ZeRO 1/2 it holds one flat fp32 shard per param group instead, and each layer is a
fragment of some rank's shard: :class:`Layout` says where, the per-layer sums are all-reduced over
the data-parallel group, and every rank applies the same per-layer ratio — the step ZeRO-0 takes.
:class:`Lamb` is the ``torch.optim.Optimizer`` glue. It knows nothing of DeepSpeed: the layouts come
from :func:`ds_bertopt.optim.zero.attach_lamb`, which ``ds_bertopt.engine.attach_extensions`` calls.
"""

from __future__ import annotations

import array
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from . import lamb_kernel, lamb_multi

Tensors = Sequence[torch.Tensor]
Scale = Union[float, torch.Tensor]
KERNELS = ("auto", "fused", "multi_tensor", "foreach")


@dataclass(frozen=True)
class Fragment:
    """The part of one layer that lies in one held tensor."""

    tensor: int
    """Index of the held tensor (in the list passed to :func:`lamb_update`)."""
    start: int
    """First element of the fragment in the flattened tensor."""
    numel: int
    """Number of elements."""
    layer: int
    """Which layer (model parameter) it belongs to, 0 … num_layers − 1."""


@dataclass
class Layout:
    """Where each layer of a param group lives in the tensors the optimizer holds."""

    fragments: tuple[Fragment, ...]
    num_layers: int
    group: object = None
    """Process group over which the per-layer sums are all-reduced; None: no reduction."""
    covers_tensors: bool = False
    """Each fragment is the whole of its held tensor (:meth:`whole`). A ZeRO shard's fragments may end before the
    shard does: its last rank with real elements holds alignment padding after them."""
    _index: dict = field(default_factory=dict, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def whole(tensors: Tensors) -> "Layout":
        """Every tensor is one whole layer (the unpartitioned case)."""
        fragments = tuple(Fragment(i, 0, t.numel(), i) for i, t in enumerate(tensors))
        return Layout(fragments, len(tensors), covers_tensors=True)

    def layer_index(self, device: torch.device) -> torch.Tensor:
        """Layer of each fragment, as an index tensor on ``device`` (cached)."""
        key = str(device)
        if key not in self._index:
            self._index[key] = torch.tensor([f.layer for f in self.fragments], dtype=torch.long, device=device)
        return self._index[key]

    def plan(self, threads: int) -> lamb_kernel.Plan:
        """The fragments as the fused kernel's piece table for ``threads`` (cached)."""
        if threads not in self._plans:
            self._plans[threads] = lamb_kernel.plan(
                [(f.tensor, f.start, f.numel, f.layer) for f in self.fragments], threads, self.covers_tensors
            )
        return self._plans[threads]


def _fused_step(kernel: str, layout: Layout, tensors: tuple, coefficients: list) -> Optional[lamb_kernel.Step]:
    """The fused kernel's step over ``tensors`` (params, grads, moments), or None for the foreach path:
    ``"auto"`` takes the kernel where it applies and builds, ``"fused"`` insists on it, ``"foreach"`` never."""
    if kernel not in KERNELS:
        raise ValueError(f"LAMB kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    found = lamb_kernel.addresses(*tensors) if kernel in ("auto", "fused") else None
    if found is not None and lamb_kernel.library() is not None:
        return lamb_kernel.Step(layout.plan(lamb_kernel.threads()), tensors, found, coefficients)
    if kernel == "fused":
        problem = lamb_kernel.unavailable_reason()
        raise RuntimeError(
            'LAMB kernel "fused" requested but '
            + (
                f"the fused CPU kernel is unavailable ({problem})"
                if problem
                else "it steps contiguous fp32 CPU tensors only"
            )
        )
    return None


def _bias_terms(steps: Sequence[int], beta1: float, beta2: float, bias_correction: bool):
    """Per tensor ``√(1−β₂ᵗ)`` and ``√(1−β₂ᵗ)/(1−β₁ᵗ)``: m̂/(√v̂ + ε) = factor · m/(√v + ε√(1−β₂ᵗ))."""
    if not bias_correction:
        return [1.0] * len(steps), [1.0] * len(steps)
    terms = {t: (math.sqrt(1.0 - beta2**t), math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)) for t in set(steps)}
    return [terms[t][0] for t in steps], [terms[t][1] for t in steps]


def adam_directions(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    steps: Sequence[int],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_scale: Scale = 1.0,
    scratch: Optional[tuple[Tensors, Tensors]] = None,
) -> list[torch.Tensor]:
    """Advance the moments in place with ``grad_scale × grad``; return ``m̂/(√v̂ + ε) + λw``.

    ``steps`` are the step numbers (1-based, after this step) used for bias correction.
    ``grad_scale``: a number, or a 0-d tensor (the clip factor, never read on the host).
    ``scratch``: two buffer lists shaped like ``params`` to compute into (the result is the
    second); without it the temporaries are allocated.
    """
    # Few passes over memory (CPU steps are bandwidth-bound): m by lerp, bias corrections folded
    # into ε and one per-tensor factor, u = λw + factor·m/(√v + ε') by one addcdiv.
    if isinstance(grad_scale, torch.Tensor):  # scaled gradients (into the √v buffer, free until the moments are done)
        grad_scale = grad_scale.to(grads[0].device) if grads else grad_scale
        if scratch is None:
            grads = torch._foreach_mul(list(grads), grad_scale)
        else:
            for g, d in zip(grads, scratch[0]):
                torch.mul(g, grad_scale, out=d)
            grads = scratch[0]
        grad_scale = 1.0
    if grad_scale == 1.0:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    else:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=(1.0 - beta1) * grad_scale)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=(1.0 - beta2) * grad_scale * grad_scale)
    bc2_sqrt, factors = _bias_terms(steps, beta1, beta2, bias_correction)
    if scratch is None:
        denom = torch._foreach_sqrt(exp_avg_sqs)
        updates = torch._foreach_mul(params, weight_decay)
    else:
        denom, updates = scratch
        for v, d, p, u in zip(exp_avg_sqs, denom, params, updates):
            torch.sqrt(v, out=d)
            torch.mul(p, weight_decay, out=u)
    torch._foreach_add_(denom, [eps * b for b in bc2_sqrt])
    torch._foreach_addcdiv_(updates, exp_avgs, denom, factors)
    return list(updates)


def _fragment_views(tensors: Tensors, fragments: Sequence[Fragment]) -> list[torch.Tensor]:
    # A whole tensor is used as is (it may be non-contiguous; only flat shards need views).
    return [
        tensors[f.tensor]
        if f.start == 0 and f.numel == tensors[f.tensor].numel()
        else tensors[f.tensor].view(-1).narrow(0, f.start, f.numel)
        for f in fragments
    ]


def layer_sq_norms(params: Tensors, updates: Tensors, layout: Layout) -> torch.Tensor:
    """``[[Σw² per layer], [Σu² per layer]]`` (float64) over the fragments held here."""
    views = _fragment_views(params, layout.fragments) + _fragment_views(updates, layout.fragments)
    norms = torch.stack(torch._foreach_norm(views)).to(torch.float64).view(2, -1)
    sums = torch.zeros(2, layout.num_layers, dtype=torch.float64, device=norms.device)
    sums.index_add_(1, layout.layer_index(norms.device), norms * norms)
    return sums


def trust_ratios(
    weight_sq: torch.Tensor,
    update_sq: torch.Tensor,
    *,
    min_ratio: Optional[float] = None,
    max_ratio: Optional[float] = None,
) -> torch.Tensor:
    """``‖w‖/‖u‖`` per layer from squared norms.

    1 where either norm is 0 (a zero layer, e.g. a fresh bias, or a zero update: nothing to scale
    against); only computed ratios are clamped to ``[min_ratio, max_ratio]``.
    """
    ratio = (weight_sq / update_sq).sqrt()  # inf/nan where a norm is 0: replaced below
    if min_ratio is not None or max_ratio is not None:
        ratio = ratio.clamp(min=min_ratio, max=max_ratio)
    return torch.where((weight_sq > 0) & (update_sq > 0), ratio, 1.0)


def lamb_update(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_scale: Scale = 1.0,
    adapt: bool = True,
    min_trust_ratio: Optional[float] = None,
    max_trust_ratio: Optional[float] = None,
    layout: Optional[Layout] = None,
    allreduce: Optional[Callable[[torch.Tensor], None]] = None,
    scratch=None,
    kernel: str = "auto",
) -> torch.Tensor:
    """One LAMB step on ``params`` in place; returns the per-layer trust ratios used (float64, on the device).

    ``layout`` (default: each tensor a whole layer) says which layer each fragment belongs to;
    ``allreduce`` sums the ``[2, num_layers]`` float64 norm tensor in place across the ranks that
    hold the other fragments. With ``adapt=False`` the ratio is 1 (plain AdamW step). ``grad_scale``: a number or
    a 0-d tensor. ``kernel``: ``"auto"`` (the fused CPU kernel where it applies and builds, else the multi-tensor
    step where torch's fused Adam kernel takes the tensors, else foreach), ``"fused"`` or ``"multi_tensor"`` (insist)
    or ``"foreach"``; the multi-tensor step leaves the clipped gradients in ``grads``. ``scratch``: as in
    :func:`adam_directions`, or a function returning it (called unless the fused CPU kernel steps).
    """
    layout = layout or Layout.whole(params)
    if not layout.fragments:  # a ZeRO partition of padding only: no layer here, but the ranks' reduction is joined
        return _nothing_held(layout.num_layers, params[0].device, adapt, allreduce, (min_trust_ratio, max_trust_ratio))
    bc2_sqrt, factors = _bias_terms(steps, beta1, beta2, bias_correction)
    tensors = (params, grads, exp_avgs, exp_avg_sqs)
    step = _fused_step(kernel, layout, tensors, [(f, eps * b) for f, b in zip(factors, bc2_sqrt)])
    if step is not None:
        return _fused_update(
            step,
            lr=lr,
            betas=(beta1, beta2),
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            adapt=adapt,
            clamps=(min_trust_ratio, max_trust_ratio),
            num_layers=layout.num_layers,
            allreduce=allreduce,
        )
    options = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
    scratch = scratch() if callable(scratch) else scratch
    if _multi_tensor(kernel, tensors, (beta1, beta2), bias_correction):
        out = None if scratch is None else scratch[1]
        updates = lamb_multi.directions(*tensors, steps, grad_scale=grad_scale, out=out, **options)
    else:
        updates = adam_directions(*tensors, steps, grad_scale=grad_scale, scratch=scratch, **options)
    param_views, update_views = _fragment_views(params, layout.fragments), _fragment_views(updates, layout.fragments)
    if not adapt:  # ratio 1: one multi-tensor update with a host scalar
        torch._foreach_add_(param_views, update_views, alpha=-lr)
        return torch.ones(layout.num_layers, dtype=torch.float64, device=params[0].device)
    sums = layer_sq_norms(params, updates, layout)
    ratios = _reduced_ratios(sums, allreduce, (min_trust_ratio, max_trust_ratio))
    # p += (−lr·ratio)·u per fragment, the scale a 0-d tensor (no host sync). torch's multi-tensor kernels take
    # per-tensor scalars from the host only (ForeachUtils.h convert_tensor_to_scalar_list), so on CUDA this is one
    # kernel per fragment, together one pass.
    scales = (ratios * -lr).to(params[0].dtype).index_select(0, layout.layer_index(ratios.device))
    torch._foreach_addcmul_(param_views, update_views, list(scales.unbind()))
    return ratios


def _nothing_held(num_layers: int, device: torch.device, adapt: bool, allreduce, clamps: tuple) -> torch.Tensor:
    """The step of a rank whose flat shard holds DeepSpeed's alignment padding only (``stage_1_and_2.py`` pads each
    group to a multiple of 2 × world and splits it evenly, so at large worlds the last ranks of a small group hold no
    element of any layer). Nothing is updated (the padding is never read), but the per-layer sums are all-reduced as
    on every other rank, with zeros from here: the ranks' collectives stay matched and the ratios are theirs. The
    layout alone decides this, on the host, when it is attached: no value is read from the device."""
    if not adapt:
        return torch.ones(num_layers, dtype=torch.float64, device=device)
    sums = torch.zeros(2, num_layers, dtype=torch.float64, device=device)
    return _reduced_ratios(sums, allreduce, clamps)


def _multi_tensor(kernel: str, tensors: tuple, betas: tuple, bias_correction: bool) -> bool:
    """Whether the step takes :mod:`.lamb_multi`'s kernel: ``"auto"`` where it applies, ``"multi_tensor"``
    insists (refused in one line where it cannot), ``"foreach"`` never."""
    if kernel not in ("auto", "multi_tensor"):
        return False
    problem = lamb_multi.unusable(tensors, betas, bias_correction)
    if problem and kernel == "multi_tensor":
        raise RuntimeError(f'LAMB kernel "multi_tensor" requested but {problem}')
    return problem is None


def _reduced_ratios(sums: torch.Tensor, allreduce, clamps: tuple) -> torch.Tensor:
    """Per-layer ratios from this rank's ``[2, num_layers]`` sums, all-reduced first when layers are split."""
    if allreduce is not None:
        allreduce(sums)
    return trust_ratios(sums[0], sums[1], min_ratio=clamps[0], max_ratio=clamps[1])


def _fused_update(
    step: lamb_kernel.Step,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    grad_scale: Scale,
    adapt: bool,
    clamps: tuple,
    num_layers: int,
    allreduce,
) -> torch.Tensor:
    """:func:`lamb_update` through :mod:`.lamb_kernel`: pass 1 (moments, per-piece sums), the ratios, pass 2."""
    if isinstance(grad_scale, torch.Tensor):
        gscale = grad_scale.detach().to(torch.float32).reshape(()).contiguous()
    else:
        gscale = array.array("f", [grad_scale])
    if not adapt:  # ratio 1: pass 1 knows the update and applies it (AdamW's single pass)
        step.moments(*betas, weight_decay, gscale, scale=array.array("f", [-lr]) * step.k)
        return torch.ones(num_layers, dtype=torch.float64)
    # Without an all-reduce, a piece that is its whole layer is stepped inside pass 1 (lamb_kernel.scale_of is
    # trust_ratios' rule; tests/test_optim_lamb.py::test_fused_kernel_one_sweep_equals_two_passes holds them equal).
    fuse = (lr, *clamps) if allreduce is None else None
    per_piece = step.moments(*betas, weight_decay, gscale, fuse=fuse).t()
    if step.plan.whole and allreduce is None:  # the pieces are the layers
        ratios = _reduced_ratios(per_piece, allreduce, clamps)
        if step.pending:
            step.apply(weight_decay, (ratios * -lr).to(torch.float32))
        return ratios
    sums = torch.zeros(2, num_layers, dtype=torch.float64).index_add_(1, step.plan.layer, per_piece)
    ratios = _reduced_ratios(sums, allreduce, clamps)
    if step.pending:
        step.apply(weight_decay, (ratios * -lr).to(torch.float32).index_select(0, step.plan.layer))
    return ratios


def global_grad_norm(grads: Tensors) -> torch.Tensor:
    """L2 norm of all ``grads`` together, a 0-d tensor on their device."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads))))


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale that brings a gradient of global norm ``norm`` down to ``max_norm`` (1 if already below); a tensor
    like ``norm``, computed on its device."""
    return max_norm / torch.as_tensor(norm).clamp(min=max_norm)


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled weight decay, per-layer trust ratio, optional global-norm clipping.

    Param-group keys: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``, ``adapt``
    (apply the trust ratio; False gives plain AdamW steps, used for biases and LayerNorm weights),
    ``min_trust_ratio``, ``max_trust_ratio``. ``max_grad_norm`` (0: off) clips the global
    gradient norm before the moments, as NVIDIA's and MLPerf's LAMB do. ``kernel``: ``"auto"`` (the fused CPU
    kernel where it applies, else multi-tensor, else foreach), ``"fused"``, ``"multi_tensor"`` or ``"foreach"`` (see
    :func:`lamb_update`).

    Under DeepSpeed, call ``ds_bertopt.optim.zero.attach_lamb(optimizer, engine)`` after
    ``deepspeed.initialize`` (``ds_bertopt.engine.initialize`` does): with ZeRO 1/2 the held tensors are flat
    shards and the trust ratio would otherwise be per shard. Stepping an unattached flat shard raises.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        adapt: bool = True,
        min_trust_ratio: Optional[float] = None,
        max_trust_ratio: Optional[float] = None,
        max_grad_norm: float = 0.0,
        kernel: str = "auto",
    ):
        if kernel not in KERNELS:
            raise ValueError(f"LAMB kernel {kernel!r}: use one of {', '.join(KERNELS)}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adapt=adapt,
            min_trust_ratio=min_trust_ratio,
            max_trust_ratio=max_trust_ratio,
        )
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        self.kernel = kernel
        # Tensors known to be whole layers, and flat shards with their layouts (keyed by id: ZeRO
        # hands us its param groups one at a time, so group indices are not stable).
        self._whole_layers: set[int] = {id(p) for g in self.param_groups for p in g["params"]}
        self._layouts: dict[int, Layout] = {}
        self._whole_layouts: dict[tuple, Layout] = {}  # per group of whole layers (caches the kernel's piece table)
        self._grad_norm_source: Optional[Callable[[], Scale]] = None
        # CPU foreach path only: reused buffers for √v and the update (fresh allocations page-fault every step);
        # not optimizer state, so not checkpointed. GPU allocators cache, so there we allocate.
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Per-layer ratios of the last step, one tensor per group stepped (diagnostics and tests).
        self.last_trust_ratios: list[torch.Tensor] = []
        self.last_grad_scale: Scale = 1.0  # the clipping factor of the last step (a 0-d tensor when clipping)

    # --- wiring ------------------------------------------------------------------------------
    def set_layout(self, tensor: torch.Tensor, layout: Layout) -> None:
        """Declare that ``tensor`` (a flat shard this optimizer holds) is made of ``layout``'s fragments."""
        self._layouts[id(tensor)] = layout
        self._whole_layers.discard(id(tensor))

    def mark_whole_layers(self, tensors: Tensors) -> None:
        """Declare that each of ``tensors`` is one whole layer (e.g. DeepSpeed's fp32 copies)."""
        self._whole_layers.update(id(t) for t in tensors)

    def set_grad_norm_source(self, source: Optional[Callable[[], Scale]]) -> None:
        """Where the global gradient norm comes from when this optimizer sees only a shard of it (a 0-d tensor, so
        that it is never read on the host)."""
        self._grad_norm_source = source

    # --- the step ----------------------------------------------------------------------------
    def _clip_scale(self) -> Scale:
        if self.max_grad_norm <= 0:
            return 1.0
        if self._grad_norm_source is not None:
            norm = self._grad_norm_source()
        else:
            norm = global_grad_norm([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None])
        return clip_factor(norm, self.max_grad_norm)

    def _layout_for(self, params: list[torch.Tensor]) -> Layout:
        flat = [p for p in params if id(p) in self._layouts]
        if flat:
            if len(params) != 1:
                raise RuntimeError(
                    f"LAMB: a param group mixes a flat shard with {len(params) - 1} other "
                    "tensors; DeepSpeed holds one flat shard per group"
                )
            return self._layouts[id(flat[0])]
        unknown = [p for p in params if id(p) not in self._whole_layers]
        if unknown:
            raise RuntimeError(
                f"LAMB was handed a tensor it was not built with (shape {tuple(unknown[0].shape)}): DeepSpeed "
                "flattened the master weights, so the trust ratio would be per shard, not per layer. Create the "
                "engine with ds_bertopt.engine.initialize, or call "
                "ds_bertopt.optim.zero.attach_lamb(optimizer, engine) after "
                "deepspeed.initialize"
            )
        key = tuple((id(p), p.numel()) for p in params)
        if key not in self._whole_layouts:
            self._whole_layouts[key] = Layout.whole(params)
        return self._whole_layouts[key]

    def _initialise_state_only(self) -> bool:
        """DeepSpeed's fp16/bf16 wrappers create optimizer state by stepping once with all-zero gradients
        before training (``FP16_UnfusedOptimizer.initialize_optimizer_states``, in its ``__init__``, over
        fp32 copies we have not been told about yet). Such a step must not move the weights (weight decay
        alone would) nor count for bias correction: it only creates the moments. Only tensors we were
        neither built with nor attached to qualify (never a ZeRO shard, whose per-layer norms are
        all-reduced: skipping that on one rank would desynchronise the ranks); one host check, on the first
        call only (while no state exists)."""
        held = [p for g in self.param_groups for p in g["params"]]
        if any(self.state.values()) or any(id(p) in self._whole_layers or id(p) in self._layouts for p in held):
            return False
        grads = [p.grad for p in held if p.grad is not None]
        if not grads or bool(torch.stack([g.ne(0).any() for g in grads]).any()):
            return False
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(
                    step=0,
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )
        return True

    def _scratch_for(self, params: list[torch.Tensor]) -> Optional[tuple[Tensors, Tensors]]:
        """The foreach path's two reused buffers per tensor, on CPU."""
        if params[0].device.type != "cpu":
            return None
        for p in params:
            if id(p) not in self._scratch or self._scratch[id(p)][0].shape != p.shape:
                self._scratch[id(p)] = (torch.empty_like(p), torch.empty_like(p))
        buffers = [self._scratch[id(p)] for p in params]
        return [b[0] for b in buffers], [b[1] for b in buffers]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._initialise_state_only():
            return loss
        grad_scale = self.last_grad_scale = self._clip_scale()
        self.last_trust_ratios = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            layout = self._layout_for(params)
            states = [self.state[p] for p in params]
            for p, st in zip(params, states):
                if "step" not in st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
            reduce = None
            if layout.group is not None:
                reduce = functools.partial(torch.distributed.all_reduce, group=layout.group)
            beta1, beta2 = group["betas"]
            ratios = lamb_update(
                params,
                [p.grad for p in params],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [st["step"] for st in states],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"],
                grad_scale=grad_scale,
                adapt=group["adapt"],
                min_trust_ratio=group["min_trust_ratio"],
                max_trust_ratio=group["max_trust_ratio"],
                layout=layout,
                allreduce=reduce,
                scratch=functools.partial(self._scratch_for, params),
                kernel=self.kernel,
            )
            self.last_trust_ratios.append(ratios)
        return loss


def describe_lamb(optimizer: Lamb) -> str:
    """One line: groups, which take the trust ratio, clipping, kernel."""
    groups = ", ".join(
        f"{len(g['params'])} tensors wd {g['weight_decay']:g} {'with' if g['adapt'] else 'without'} trust ratio"
        for g in optimizer.param_groups
    )
    clip = f"global-norm clip {optimizer.max_grad_norm:g}" if optimizer.max_grad_norm > 0 else "no LAMB clipping"
    kernel = {
        "auto": "fused CPU kernel where it applies, else multi-tensor (torch's fused Adam kernel), else foreach",
        "fused": "fused CPU kernel",
        "multi_tensor": "multi-tensor (torch's fused Adam kernel)",
        "foreach": "foreach",
    }[optimizer.kernel]
    return f"LAMB (ds_bertopt): {groups}; {clip}; {kernel}"
