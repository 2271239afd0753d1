"""The WTA-CRS sampled linear: an ``nn.Linear`` whose backward keeps only ``k`` input rows.

* :class:`SampledLinear` is a drop-in for ``nn.Linear`` (it *is* one: same parameters, same
  state-dict keys, same forward). In training with grad enabled it saves, instead of the whole
  input, the ``k`` rows chosen by :func:`~ds_bertopt.wtacrs.estimator.select_rows`, pre-scaled by
  their weights, plus their indices. ``∇X`` and ``∇b`` are exact; ``∇W`` is the unbiased estimate.
* :class:`BatchContext` carries what the layers cannot see themselves: which token rows are padding
  (from the ``attention_mask`` keyword of the model's forward), how many rows are not padding (keyword
  ``wtacrs_num_valid_rows``, a host ``int``), and, for the gradient-norm cache, which examples are in
  the batch (keyword ``wtacrs_example_ids``) and, for a packed (padding-free) row, where each token sits in its
  example (keyword ``wtacrs_packed_index``: its flat position in ``[examples, longest]``, so the cache keys a packed
  token by its example and position exactly as a padded one); these keywords are removed before the model sees
  them.
  :func:`install_context` hooks it onto the root module. It also shares one row selection
  among sampled linears that read the *same* input tensor (q/k/v, or LoRA's A projections of q and
  v): the stored rows are one tensor, saved once, otherwise three selections would store 3k rows.

No host sync in a training step: the budget ``k`` is computed on the host from
``wtacrs_num_valid_rows`` when the caller passes it (the training loop counts the real tokens before
it moves the batch to the device) and from the input's row count otherwise (padding rows then count
towards ``k``: more rows stored than needed, still at most ``k``); the selection itself has static
shapes (:func:`~ds_bertopt.wtacrs.estimator.select_rows`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cache import GradNormCache
from .estimator import budget, row_probabilities, select_rows
from .zero import autocast_dtype, gathered, no_autocast


def rebind_linear(cls, linear: nn.Module) -> nn.Module:
    """An instance of ``cls`` (an ``nn.Linear``-like class) on ``linear``'s own weight and bias, no copy:
    state-dict keys and optimizer references stay valid. ``__init__`` is skipped (it would allocate)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.in_features, module.out_features = linear.in_features, linear.out_features
    module.weight, module.bias = linear.weight, linear.bias
    module.train(linear.training)
    return module


EXAMPLE_IDS_KWARG = "wtacrs_example_ids"
"""Forward keyword with the batch's example ids (int64 tensor, one per sequence) for the gradient-norm cache."""
PACKED_INDEX_KWARG = "wtacrs_packed_index"
"""Forward keyword of a packed row (unpadded models): each token's flat position ``example × width + position`` in
the padded ``[examples, width]`` layout (``ds_bertopt.data.collate.padded_positions``), for the gradient-norm cache."""
NUM_VALID_ROWS_KWARG = "wtacrs_num_valid_rows"
"""Forward keyword with the number of non-padding token rows (``int(attention_mask.sum())`` counted on the
host before the batch moves to the device); sets the budget ``k = ratio · N'`` without a host sync. It
must be that count: ``k ≥ N'`` is taken to mean every contributing row fits."""


@dataclass
class _SharedRows:
    source: weakref.ref
    version: int
    key: tuple
    stored: torch.Tensor
    indices: torch.Tensor
    row_weights: Optional[torch.Tensor]
    cache_update: Optional[Callable]


class BatchContext:
    """Per-model state of the current forward: padding, example ids, shared selections."""

    def __init__(self) -> None:
        self.valid: Optional[torch.Tensor] = None
        self.example_ids: Optional[torch.Tensor] = None
        self.num_valid_rows: Optional[int] = None
        self.packed_index: Optional[torch.Tensor] = None
        self.packed_width: Optional[int] = None
        self._layout: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._shared: dict[int, _SharedRows] = {}

    def begin(
        self,
        attention_mask: Optional[torch.Tensor],
        example_ids: Optional[torch.Tensor],
        num_valid_rows: Optional[int] = None,
        packed_index: Optional[torch.Tensor] = None,
        packed_width: Optional[int] = None,
    ) -> None:
        """``packed_width``: the padded layout's row width ``packed_index`` was made with (``max_seqlen``)."""
        self._shared.clear()
        self.valid = attention_mask.bool() if attention_mask is not None else None
        self.example_ids = example_ids
        self.num_valid_rows = _host_count(num_valid_rows)
        if packed_index is not None and packed_width is None:
            raise ValueError(f"{PACKED_INDEX_KWARG}: pass max_seqlen (the width of its padded layout) in the same call")
        self.packed_index, self.packed_width = packed_index, packed_width
        self._layout: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def end(self) -> None:
        self._shared.clear()  # the graph keeps what backward needs; drop our references

    def packed_layout(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(packed index [T], valid [examples, width])`` when ``x`` is the packed row of the example ids (``T``
        rows), for the cache; the padded layout's mask is built on the device (no host sync)."""
        index, ids = self.packed_index, self.example_ids
        if index is None or ids is None or x.numel() // max(x.shape[-1], 1) != index.numel():
            return None
        if self._layout is None or self._layout[0].device != x.device:  # once per forward
            index = index.to(x.device)
            valid = torch.zeros(ids.numel() * self.packed_width, dtype=torch.bool, device=x.device)
            self._layout = (index, valid.index_fill_(0, index, True).view(ids.numel(), self.packed_width))
        return self._layout

    def rows_valid(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Per-row padding flags for ``x`` (``B × L × d``) when the mask matches its shape."""
        if self.valid is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(self.valid.shape):
            return self.valid.to(x.device)
        return None

    def budget_rows(self, x: torch.Tensor, mask_matches: bool) -> int:
        """The host row count ``N'`` the budget of ``x`` is taken from (no device read)."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if mask_matches and self.num_valid_rows is not None:
            return min(self.num_valid_rows, rows)
        return rows

    def lookup(self, x: torch.Tensor, key: tuple) -> Optional[_SharedRows]:
        entry = self._shared.get(id(x))
        if entry is not None and entry.source() is x and entry.version == x._version and entry.key == key:
            return entry
        return None

    def remember(self, x: torch.Tensor, entry: _SharedRows) -> None:
        # Only the latest input: the linears that share one read it one after another (q, k, v; LoRA's A of q
        # and v with the frozen k between). Activation checkpointing re-runs layers in backward, where no root
        # forward ends to clear this; keeping one entry bounds what such a replay leaves behind to one selection.
        self._shared.clear()
        self._shared[id(x)] = entry


def _host_count(value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            raise ValueError(
                f"{NUM_VALID_ROWS_KWARG}: pass a host int (the count of attention_mask on the host "
                f"before the batch moves); got a {value.device.type} tensor of shape {tuple(value.shape)}"
            )
        value = int(value)  # a CPU scalar: no device involved
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{NUM_VALID_ROWS_KWARG}: must be a non-negative int, got {value!r}")
    return value


def _begin_hook(context: BatchContext, module, args, kwargs):
    example_ids = kwargs.pop(EXAMPLE_IDS_KWARG, None)
    num_valid_rows = kwargs.pop(NUM_VALID_ROWS_KWARG, None)
    packed_index = kwargs.pop(PACKED_INDEX_KWARG, None)
    width = kwargs.get("max_seqlen")
    context.begin(kwargs.get("attention_mask"), example_ids, num_valid_rows, packed_index, width and int(width))
    return args, kwargs


def _end_hook(context: BatchContext, module, args, kwargs, output):
    context.end()


def install_context(model: nn.Module) -> BatchContext:
    """Attach (once) a :class:`BatchContext` fed by ``model``'s forward keywords; return it."""
    context = getattr(model, "_wtacrs_context", None)
    if context is None:
        context = BatchContext()
        object.__setattr__(model, "_wtacrs_context", context)  # not a submodule, not in state_dict
        model.register_forward_pre_hook(functools.partial(_begin_hook, context), with_kwargs=True)
        model.register_forward_hook(functools.partial(_end_hook, context), with_kwargs=True)
    return context


def feed_context(outer: nn.Module, inner: nn.Module) -> bool:
    """Let ``outer``'s forward keywords feed the :class:`BatchContext` of ``inner`` (a converted model that ``outer``
    runs without calling its forward: the unpadded wrapper, ``ds_bertopt.model.heads.UnpaddedTaskModel``). A packed
    batch has no padding rows: the context gets no mask, and ``wtacrs_num_valid_rows`` is its token count. Returns
    whether ``inner`` had a context to feed."""
    context = getattr(inner, "_wtacrs_context", None)
    if context is None:
        return False
    outer.register_forward_pre_hook(functools.partial(_begin_hook, context), with_kwargs=True)
    outer.register_forward_hook(functools.partial(_end_hook, context), with_kwargs=True)
    return True


class _SampledLinearFn(torch.autograd.Function):
    """``y = x Wᵀ + b``; backward from the pre-scaled stored rows (see the module docstring).

    ``row_weights`` is ``None`` when the rows are pre-scaled (fp32/bf16: one GEMM over k rows). In
    fp16 an importance weight times an activation can overflow, so there the rows are stored as
    they are and the weights are applied to the output-gradient rows inside an fp32 GEMM.

    With ``source`` (``keep: input``) nothing is copied in forward: ``source``, the linear's input before any
    autocast cast, is saved as it is (free when something else keeps it anyway), and backward gathers and scales
    the ``k`` rows from it exactly as forward would have (same values, same GEMM).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stored, indices, row_weights, cache_update, source):
        ctx.from_source = source is not None
        ctx.save_for_backward(weight, source if ctx.from_source else stored, indices, row_weights)
        ctx.has_bias = bias is not None
        ctx.cache_update = cache_update
        ctx.device_type = x.device.type
        ctx.compute_dtype = x.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, stored, indices, row_weights = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        with no_autocast(ctx.device_type), gathered(weight):
            if ctx.needs_input_grad[0]:
                grad_x = grad_out.matmul(weight.to(grad_out.dtype))
            if ctx.needs_input_grad[1]:
                if ctx.from_source:  # the rows forward would have stored, from the kept input
                    stored, row_weights = _rows_to_store(
                        stored.reshape(-1, stored.shape[-1]), indices, row_weights, ctx.compute_dtype
                    )
                if row_weights is None:
                    grad_w = rows[indices].t().matmul(stored.to(rows.dtype))
                else:
                    picked = rows[indices].float() * row_weights.unsqueeze(1)
                    grad_w = picked.t().matmul(stored.float())
                grad_w = grad_w.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = rows.sum(0).to(weight.dtype)
        if ctx.cache_update is not None:
            ctx.cache_update(torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32))
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _rows_to_store(rows: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype):
    """``(stored rows, row weights or None)``: pre-scaled in ``dtype``, or unscaled with fp32 weights in fp16."""
    if dtype == torch.float16:
        return rows[indices].to(dtype), weights.float()
    picked = rows[indices].float()  # a fresh k-row copy (fp32 input) or cast: scale it in place
    return picked.mul_(weights.float().unsqueeze(1)).to(dtype), None


class SampledLinear(nn.Linear):
    """``nn.Linear`` with a WTA-CRS weight gradient; build it with :meth:`from_linear`."""

    ratio: float
    min_k: int
    keep_input: bool

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        ratio: float,
        min_k: int = 32,
        context: Optional[BatchContext] = None,
        cache_capacity: int = 0,
        keep_input: bool = False,
    ) -> "SampledLinear":
        """Wrap ``linear``'s own parameters (no copy: state dicts and optimizer references stay valid).
        ``keep_input``: keep a reference to the whole input instead of copying the ``k`` rows (for an input
        that something else keeps anyway; the weight gradient is the same)."""
        module = rebind_linear(cls, linear)
        module.ratio, module.min_k, module.keep_input = float(ratio), int(min_k), bool(keep_input)
        module.generator = None
        object.__setattr__(module, "context", context)
        object.__setattr__(module, "cache", GradNormCache(cache_capacity) if cache_capacity > 0 else None)
        return module

    def extra_repr(self) -> str:
        keep = ", keep=input" if self.keep_input else ""
        return f"{super().extra_repr()}, ratio={self.ratio}, min_k={self.min_k}{keep}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        device_type = x.device.type
        compute_dtype = autocast_dtype(device_type) if x.is_floating_point() else None
        weight, bias = self.weight, self.bias
        if compute_dtype is not None:  # what F.linear does under autocast, done explicitly
            weight, bias = weight.to(compute_dtype), bias.to(compute_dtype) if bias is not None else None
        compute_x = x.to(compute_dtype) if compute_dtype is not None else x
        stored, indices, row_weights, cache_update = self._select(x, compute_x.dtype)
        source = x if self.keep_input else None
        with no_autocast(device_type):
            return _SampledLinearFn.apply(compute_x, weight, bias, stored, indices, row_weights, cache_update, source)

    @torch.no_grad()
    def _select(self, x: torch.Tensor, dtype: torch.dtype):
        """Stored rows, their indices, their weights when not pre-scaled (fp16), the cache update. With
        ``keep_input`` no rows: ``(None, indices, weights, cache update)``."""
        key = (self.ratio, self.min_k, dtype, self.keep_input)
        context = self.context
        if context is not None:
            shared = context.lookup(x, key)
            if shared is not None:
                return shared.stored, shared.indices, shared.row_weights, None  # the first member updates the cache
        rows = x.reshape(-1, x.shape[-1])
        valid = context.rows_valid(x) if context is not None else None
        scores, cache_update = None, None
        if self.cache is not None and valid is not None and context.example_ids is not None:
            ids = context.example_ids
            scores = self.cache.scores(ids, valid).flatten()
            cache_update = functools.partial(_update_cache, self.cache, ids, valid)
        packed = context.packed_layout(x) if self.cache is not None and context is not None else None
        if packed is not None:  # every row real: the cache's scores read at each token's (example, position)
            index, layout = packed
            scores = self.cache.scores(context.example_ids, layout).flatten().index_select(0, index)
            cache_update = functools.partial(_update_packed_cache, self.cache, context.example_ids, layout, index)
        flat_valid = valid.flatten() if valid is not None else None
        p = row_probabilities(rows, flat_valid, scores)
        num_rows = context.budget_rows(x, valid is not None) if context is not None else rows.shape[0]
        selection = select_rows(
            p, budget(num_rows, self.ratio, self.min_k), generator=self.generator, max_positive=num_rows
        )  # padding rows have p = 0: at most N' positive
        # slots in row order: the k-row gather reads memory in order, and at ratio 1 the GEMM sums as nn.Linear's
        indices, slot_order = torch.sort(selection.indices)
        weights = selection.weights[slot_order]
        if self.keep_input:
            stored, row_weights = None, weights.float()
        else:
            stored, row_weights = _rows_to_store(rows, indices, weights, dtype)
        if context is not None:
            context.remember(
                x, _SharedRows(weakref.ref(x), x._version, key, stored, indices, row_weights, cache_update)
            )
        return stored, indices, row_weights, cache_update


def _update_cache(cache: GradNormCache, example_ids, valid, row_norms):
    cache.update(example_ids, valid, row_norms.reshape(valid.shape))


def _update_packed_cache(cache: GradNormCache, example_ids, valid, index, row_norms):
    padded = row_norms.new_zeros(valid.numel()).index_copy_(0, index, row_norms.reshape(-1).to(row_norms.dtype))
    cache.update(example_ids, valid, padded.view(valid.shape))
