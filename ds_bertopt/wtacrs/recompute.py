"""Selective recomputation: a tensor that some op saves for backward, and that a cheap producer can rebuild from
an input kept anyway, is replaced in the saved graph by a recipe; backward rebuilds it. Exact (the same kernel on
the same inputs gives the same bits).

Two producers, each a kit switch (``"wtacrs": {"kit": {...}}``):

* ``recompute_qkv`` — the q/k/v projections. The attention kernel (SDPA's flash kernel, or an eager attention's
  matmuls) keeps q, k and v, 3 × B·L·h; their input, the previous LayerNorm's output, is kept anyway (by that
  LayerNorm under ``layernorm_saves_output``, by the projections otherwise). Backward re-runs the projections:
  three h×h GEMMs per layer. Measured on MiniLM-L6 (64 × 128, fp32) it frees 36 MiB per layer.
* ``recompute_ffn`` — the fused FFN input projection + activation (:class:`~ds_bertopt.wtacrs.kit.GeluLinear`,
  i.e. ``recompute_gelu``). The FFN output projection keeps the 4h-wide activation output for its weight gradient;
  backward rebuilds it from the FFN input, and the fused projection's own backward then reuses the rebuilt
  pre-activation instead of computing it again: the FFN keeps only its input, at the one extra GEMM that
  ``recompute_gelu`` already costs.

How: while the model runs a training forward (root forward pre/post hooks), one pair of
``torch.autograd.graph.saved_tensors_hooks`` is active. A producer records its output when it runs (a weak
reference to its storage, its version counter) with a recipe: the module, its input, the autocast state.
The pack hook replaces every saved view of a recorded output's storage, unchanged since (same version), by the
view's geometry and the recipe; the unpack hook re-runs the module (``torch.no_grad``, the recorded autocast state,
ZeRO-3 parameters gathered as in :mod:`ds_bertopt.wtacrs.zero`) and returns the same view of the result. Every
other saved tensor passes through unchanged, or through the outer pair of hooks that was active when the forward
began (e.g. :func:`ds_bertopt.wtacrs.memory.saved_tensor_bytes`'s counter, ``torch.autograd.graph.save_on_cpu``).

Inside a region where another pair is pushed during the forward — ``torch.utils.checkpoint``, i.e. transformers'
activation checkpointing of a layer — that pair wins (torch applies only the innermost pair): such a layer is
recomputed whole by checkpointing, and no producer is recorded there (they are recorded only while our pair is the
innermost one, so the checkpoint's own recomputation in backward records nothing either).

Depends on ``torch._C._autograd._top_saved_tensors_default_hooks`` (the innermost pair; what
``torch.autograd.graph.saved_tensors_hooks.__enter__`` pushes); its absence is a one-line error when the kit part
is applied.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from .zero import gathered

try:  # a weak reference to a storage; torch.utils.checkpoint and AOTAutograd use the same class
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - depends on the torch build
    StorageWeakRef = None


def _top_hooks():
    """The innermost ``(pack, unpack)`` pair of saved-tensor hooks, or ``None``."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def check_supported() -> None:
    """Raise a one-line error when this torch lacks what the recomputation relies on."""
    if StorageWeakRef is None:
        raise RuntimeError(
            f"kit.recompute_qkv / kit.recompute_ffn: torch {torch.__version__} has no "
            f"torch.multiprocessing.reductions.StorageWeakRef"
        )
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        raise RuntimeError(
            f"kit.recompute_qkv / kit.recompute_ffn: torch {torch.__version__} has no "
            f"torch._C._autograd._top_saved_tensors_default_hooks (needed to find the active "
            f"saved-tensor hooks)"
        )


class Recipe:
    """How to rebuild one recorded output: ``rebuild()`` returns a tensor equal to it (contiguous, same shape)."""

    __slots__ = (
        "output",
        "version",
        "nbytes",
        "dtype",
        "shape",
        "rebuild",
        "inputs",
        "input_versions",
        "what",
        "cached",
        "__weakref__",
    )

    def __init__(self, output: torch.Tensor, rebuild: Callable[[], torch.Tensor], inputs: tuple, what: str):
        # a weak reference to the storage (not the tensor object: a projection's output object dies right after
        # .view(), its storage lives on in the views): while it exists no other storage gets its key
        self.output = StorageWeakRef(output.untyped_storage())
        self.version = output._version
        self.nbytes = output.untyped_storage().nbytes()
        self.dtype, self.shape = output.dtype, tuple(output.shape)
        self.rebuild = rebuild
        self.inputs = inputs
        self.input_versions = tuple(t._version for t in inputs)
        self.what = what
        self.cached: Optional[weakref.ref] = None

    def materialise(self) -> torch.Tensor:
        base = self.cached() if self.cached is not None else None
        if base is not None:
            return base
        if tuple(t._version for t in self.inputs) != self.input_versions:
            raise RuntimeError(
                f"recompute: the input of {self.what} was modified in place after its forward; "
                f"its output cannot be rebuilt for backward"
            )
        base = self.rebuild()
        if base.dtype != self.dtype or tuple(base.shape) != self.shape or not base.is_contiguous():
            raise RuntimeError(
                f"recompute: {self.what} rebuilt a {base.dtype} {tuple(base.shape)} tensor for the "
                f"saved {self.dtype} {self.shape} one"
            )
        self.cached = weakref.ref(base)
        return base


class _SavedView:
    """What the pack hook stores instead of a view of a recorded output: the recipe and the view's geometry."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: Recipe, tensor: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = (
            recipe,
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )


class _Kept:
    """A saved tensor passed through unchanged. Under saved-tensor hooks autograd no longer checks that a saved
    tensor was not modified in place before backward; this keeps that check (same version counter as detach())."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor.detach(), tensor._version  # detach(): no reference cycle via grad_fn

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.tensor.dtype} {tuple(self.tensor.shape)}] is at version "
                f"{self.tensor._version}; expected version {self.version} instead"
            )
        return self.tensor


class RecomputeScope:
    """The saved-tensor hooks of one model's training forwards, and the outputs recorded in the current one."""

    def __init__(self) -> None:
        self.recipes: dict[int, Recipe] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._pack: Optional[Callable] = None
        self.replaced = 0
        """Saved tensors replaced by a recipe so far (for tests and logs)."""

    # ---------------------------------------------------------------- forward bracket (root hooks)
    def begin(self) -> None:
        self.end()
        if not torch.is_grad_enabled():
            return
        outer = _top_hooks()
        recipes = self.recipes

        def pack(tensor: torch.Tensor):
            recipe = recipes.get(_storage_key(tensor))
            if recipe is not None and _still_the_output(recipe, tensor):
                self.replaced += 1
                return _SavedView(recipe, tensor)
            return outer[0](tensor) if outer is not None else _Kept(tensor)

        def unpack(packed):
            if isinstance(packed, _SavedView):
                base = packed.recipe.materialise()
                return base.as_strided(packed.size, packed.stride, packed.offset)
            return outer[1](packed) if outer is not None else packed.get()

        self._pack = pack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()

    def end(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self._pack = None
        self.recipes.clear()  # the saved views hold their recipes; drop ours (and the inputs they keep)

    def innermost(self) -> bool:
        """Our pair is the one torch applies right now (not inside a checkpointed region, not in backward)."""
        top = _top_hooks()
        return self._pack is not None and top is not None and top[0] is self._pack

    # ---------------------------------------------------------------- producers
    def record(self, output: torch.Tensor, rebuild: Callable[[], torch.Tensor], inputs: tuple, what: str) -> bool:
        """Remember that ``output`` can be rebuilt by ``rebuild()``; False when it cannot be replaced here."""
        if not (isinstance(output, torch.Tensor) and output.requires_grad and self.innermost()):
            return False
        if (
            output.layout != torch.strided
            or output.storage_offset() != 0
            or not output.is_contiguous()
            or output.untyped_storage().nbytes() != output.numel() * output.element_size()
        ):
            return False  # only outputs that own their whole storage: the rebuilt tensor then has its layout
        self.recipes[_storage_key(output)] = Recipe(output, rebuild, inputs, what)
        return True


def _storage_key(tensor: torch.Tensor) -> int:
    """The storage's identity (its ``StorageImpl``; kept unique by the recipe's weak reference)."""
    return tensor.untyped_storage()._cdata if tensor.layout == torch.strided else 0


def _still_the_output(recipe: Recipe, tensor: torch.Tensor) -> bool:
    """``tensor`` is a view of the recorded output as it was recorded (not written since, same dtype)."""
    return (
        not recipe.output.expired()
        and tensor._version == recipe.version
        and tensor.dtype == recipe.dtype
        and tensor.untyped_storage().nbytes() == recipe.nbytes
    )


def autocast_state(device_type: str) -> Optional[torch.dtype]:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def replay_autocast(device_type: str, dtype: Optional[torch.dtype]):
    """The autocast state a recipe was recorded under (backward runs outside the forward's autocast)."""
    if dtype is None:
        return torch.autocast(device_type=device_type, enabled=False)
    return torch.autocast(device_type=device_type, dtype=dtype)


def _module_rebuild(module: nn.Module, x: torch.Tensor, device_type: str, dtype: Optional[torch.dtype]):
    # module.forward, not module(): no hooks of ours (nor DeepSpeed's) fire for the replay; ZeRO-3 parameters
    # are gathered explicitly, as our other backwards do
    with torch.no_grad(), replay_autocast(device_type, dtype), gathered(*module.parameters(recurse=False)):
        return module.forward(x)


def _record_module_output(scope: RecomputeScope, name: str, module: nn.Module, args, output) -> None:
    if not args or not isinstance(args[0], torch.Tensor) or not module.training:
        return
    x = args[0]
    rebuild = functools.partial(_module_rebuild, module, x, x.device.type, autocast_state(x.device.type))
    scope.record(output, rebuild, (x,), name)


def _deterministic(module: nn.Module) -> bool:
    """Re-running it gives the same output: no dropout that is active in training."""
    return not any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def install_scope(model: nn.Module) -> RecomputeScope:
    """Attach (once) the :class:`RecomputeScope` of ``model``, bracketing its training forwards; return it."""
    scope = getattr(model, "_wtacrs_recompute", None)
    if scope is None:
        check_supported()
        scope = RecomputeScope()
        object.__setattr__(model, "_wtacrs_recompute", scope)  # not a submodule, not in state_dict
        _bracket(model, scope)
    return scope


def feed_scope(outer: nn.Module, inner: nn.Module) -> bool:
    """Let ``outer``'s training forwards bracket the :class:`RecomputeScope` of ``inner`` (a converted model that
    ``outer`` runs without calling its forward: the unpadded wrappers of ``ds_bertopt.model``); without it no producer
    would be recorded. Returns whether ``inner`` had a scope."""
    scope = getattr(inner, "_wtacrs_recompute", None)
    if scope is not None:
        _bracket(outer, scope)
    return scope is not None


def _bracket(model: nn.Module, scope: RecomputeScope) -> None:
    def begin(module, args, kwargs):
        if module.training:
            scope.begin()

    def end(module, args, kwargs, output):
        scope.end()

    # prepend: our pair must be active before any other pre-hook runs the model's own code
    model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True)
    model.register_forward_hook(end, with_kwargs=True, always_call=True)


def record_outputs_of(model: nn.Module, scope: RecomputeScope, names: list[str]) -> tuple[list[str], list[str]]:
    """Make the outputs of the named modules rebuildable (a forward hook each); return (recorded, skipped)."""
    recorded, skipped = [], []
    for name in names:
        module = model.get_submodule(name)
        if not _deterministic(module):
            skipped.append(name)
            continue
        module.register_forward_hook(functools.partial(_hook, scope, name))
        recorded.append(name)
    return recorded, skipped


def _hook(scope: RecomputeScope, name: str, module, args, output):
    if torch.is_grad_enabled():
        _record_module_output(scope, name, module, args, output)


@contextlib.contextmanager
def no_recompute(model: nn.Module):
    """Nothing of ``model`` is rebuilt inside the block (its forwards keep what they save): for comparisons."""
    scope = getattr(model, "_wtacrs_recompute", None)
    if scope is None:
        yield
        return
    record, scope.record = scope.record, (lambda *args, **kwargs: False)
    try:
        yield
    finally:
        scope.record = record
