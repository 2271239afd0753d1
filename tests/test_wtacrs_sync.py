"""No host sync in a training step of a converted model (the GPU-readiness check, run on CPU).

A CUDA step waits for the device whenever the host reads device data: ``.item()`` / ``bool()`` /
``int()`` / ``float()`` of a tensor (``aten._local_scalar_dense``), ``torch.nonzero``, boolean-mask
indexing, and ops whose output shape depends on the data (``unique``, ``bincount``, ``masked_select``,
``multinomial``'s validity check, ``repeat_interleave`` without ``output_size``). On CPU the same ops
still go through the dispatcher, so :class:`HostSyncDetector` (a ``TorchDispatchMode``) records each
one whose Python stack runs through ``ds_bertopt/wtacrs`` — syncs inside transformers (its SDPA mask
helper reads ``attention_mask.all()``) are not ours and not counted. ``.tolist()`` of a CPU tensor
reads memory without dispatching, so a source check covers it: the one documented host read, the
LayerNorm γ check once per optimizer step, is the only ``.tolist()`` in the per-step modules, and
:attr:`GammaGuard.host_checks` counts it.
"""

from __future__ import annotations

import ast
import copy
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_batch, tiny_family  # noqa: E402

import ds_bertopt.wtacrs as wtacrs  # noqa: E402
from ds_bertopt.configlib import load_section  # noqa: E402
from ds_bertopt.wtacrs import (
    EXAMPLE_IDS_KWARG,
    NUM_VALID_ROWS_KWARG,
    PACKED_INDEX_KWARG,
    GammaGuard,
    OutputSavingLayerNorm,  # noqa: E402
    SampledLinear,
    convert,
    prepare_model,
)
from ds_bertopt.wtacrs.cache import GradNormCache  # noqa: E402
from ds_bertopt.wtacrs.config import WtaCrsConfig  # noqa: E402
from ds_bertopt.wtacrs.estimator import row_probabilities, select_rows  # noqa: E402

OURS = str(Path(wtacrs.__file__).resolve().parent)
_aten = torch.ops.aten
_SYNC_NAMES = (
    "_local_scalar_dense.default",
    "nonzero.default",
    "equal.default",
    "is_nonzero.default",
    "masked_select.default",
    "_unique2.default",
    "unique_dim.default",
    "unique_consecutive.default",
    "bincount.default",
    "multinomial.default",
    "repeat_interleave.Tensor",
    "histc.default",
)
SYNC_OPS = {getattr(getattr(_aten, name.split(".")[0]), name.split(".")[1]) for name in _SYNC_NAMES}
BOOL_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


class HostSyncDetector(TorchDispatchMode):
    """Records ``(op, our innermost frame)`` for every host-syncing op called from under ``roots``."""

    def __init__(self, roots: tuple[str, ...] = (OURS,)):
        super().__init__()
        self.roots = roots
        self.hits: list[tuple[str, str]] = []

    @staticmethod
    def _syncs(func, args) -> bool:
        if func in SYNC_OPS:
            return True
        if func in BOOL_INDEXING:
            indices = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._syncs(func, args):
            ours = [f for f in traceback.extract_stack() if str(Path(f.filename).resolve()).startswith(self.roots)]
            if ours:
                self.hits.append((str(func), f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}"))
        return func(*args, **(kwargs or {}))


def _old_style_syncs(t: torch.Tensor) -> None:
    """What the per-step code used to do (each line a host sync on CUDA)."""
    bool((t.abs() < 1e-3).any())
    int((t > 0).sum())
    float(t.mean())
    torch.nonzero(t > 0)
    t[t > 0]
    torch.bincount((t > 0).long())
    torch.multinomial(t.abs() + 0.1, 2, replacement=True)
    torch.unique(t)


def test_the_detector_catches_each_kind_of_sync():
    detector = HostSyncDetector(roots=(str(Path(__file__).resolve()),))
    with detector:
        _old_style_syncs(torch.randn(16))
    ops = {op for op, _ in detector.hits}
    assert {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.index.Tensor",
        "aten.bincount.default",
        "aten.multinomial.default",
        "aten._unique2.default",
    } <= ops, ops
    assert sum(op == "aten._local_scalar_dense.default" for op, _ in detector.hits) == 3
    detector = HostSyncDetector()  # the same code outside ds_bertopt/wtacrs is not ours: not counted
    with detector:
        _old_style_syncs(torch.randn(16))
    assert detector.hits == []


def test_selection_cache_and_sampled_linear_have_no_host_sync():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 8, generator=gen) * (1 - torch.rand(4, 16, 1, generator=gen)) ** -0.8
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[2:, 10:] = 0
    ids = torch.tensor([3, 4, 5, 11])
    model = nn.Module()
    model.heads = nn.ModuleList(nn.Linear(8, 6) for _ in range(3))
    model.forward = lambda x, attention_mask=None: sum(h(x) for h in model.heads)  # noqa: E731
    detector = HostSyncDetector()
    with detector:
        flat = row_probabilities(x.reshape(-1, 8), mask.flatten().bool())
        select_rows(flat, 12)  # winners + draws
        select_rows(flat, 60)  # every positive row fits
        select_rows(row_probabilities(torch.zeros(5, 3)), 2)  # nothing to keep
        cache = GradNormCache(8)
        cache.update(ids, mask.bool(), torch.rand(4, 16))
        cache.scores(ids, mask.bool())
        for dtype in (torch.float32, torch.float16):
            layer = SampledLinear.from_linear(nn.Linear(8, 6).to(dtype), ratio=0.3, min_k=2)
            layer(x.to(dtype).requires_grad_()).sum().backward()
    assert detector.hits == [], detector.hits
    convert(model, ratio=0.3, targets=("heads.*",), min_k=2, cache_capacity=8)
    with detector:
        for _ in range(2):
            out = model(
                x.requires_grad_(),
                attention_mask=mask,
                **{EXAMPLE_IDS_KWARG: ids, NUM_VALID_ROWS_KWARG: int(mask.sum())},
            )
            out.sum().backward()
    assert detector.hits == [], detector.hits
    packed = nn.Module()  # the same rows packed (model.unpadded): the cache reads them by example and position
    packed.heads = nn.ModuleList(nn.Linear(8, 6) for _ in range(3))
    packed.forward = lambda x, max_seqlen=None: sum(h(x) for h in packed.heads)  # noqa: E731
    convert(packed, ratio=0.3, targets=("heads.*",), min_k=2, cache_capacity=8)
    index = torch.nonzero(mask.flatten()).flatten()  # host-made by the collator (padded_positions)
    with detector:
        for _ in range(2):
            out = packed(x[mask.bool()].detach().requires_grad_(), max_seqlen=16, **{
                EXAMPLE_IDS_KWARG: ids, PACKED_INDEX_KWARG: index, NUM_VALID_ROWS_KWARG: index.numel()})  # fmt: skip
            out.sum().backward()
    assert detector.hits == [], detector.hits


def _guards(model) -> list[GammaGuard]:
    return list({id(m.guard): m.guard for m in model.modules() if isinstance(m, OutputSavingLayerNorm)}.values())


@pytest.mark.parametrize("model_type", ["bert", "modernbert", "mpnet"])
def test_training_steps_sync_only_in_the_documented_gamma_check(model_type):
    """Kit + WTA + gradient-norm cache, dropout on: no sync from our code in forward or backward; the
    LayerNorm γ check is one batched host read after each optimizer step, none between."""
    raw = {
        "enabled": True,
        "ratio": 0.3,
        "min_k": 4,
        "grad_norm_cache": True,
        "cache_capacity": 64,
        "targets": ["ffn_out", "qkv"],
        "kit": {
            "sdpa_attention": True,
            "dropout_mask": "regenerate",
            "layernorm_saves_output": True,
            "recompute_gelu": True,
        },
    }
    model, _ = prepare_model(tiny_family(model_type, dropout=0.1), load_section(WtaCrsConfig, raw, "wtacrs"))
    model.train()
    (guard,) = _guards(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tiny_batch(batch=4, seq=16, pad_from=11)
    batch.update({EXAMPLE_IDS_KWARG: torch.arange(4), NUM_VALID_ROWS_KWARG: int(batch["attention_mask"].sum())})

    def micro_step():
        model(**batch).loss.backward()

    micro_step()
    optimizer.step()
    checks = guard.host_checks
    detector = HostSyncDetector()
    with detector:
        micro_step()  # first forward after a step: the one batched γ check
        assert guard.host_checks == checks + 1
        micro_step()  # gradient accumulation: γ unchanged, no check
        assert guard.host_checks == checks + 1
    assert detector.hits == [], detector.hits
    optimizer.step()
    micro_step()
    assert guard.host_checks == checks + 2
    assert any(isinstance(m, SampledLinear) for m in model.modules())


def test_gamma_guard_recheck_follows_the_weights():
    """In-place writes and optimizer steps make the guard look again; a γ driven to 0 falls back to the input."""
    torch.manual_seed(0)
    norms = [OutputSavingLayerNorm.from_layernorm(nn.LayerNorm(8)) for _ in range(3)]
    guard = GammaGuard()
    for norm in norms:
        norm.guard = guard
        guard.add(norm)
    x = torch.randn(2, 4, 8, requires_grad=True)
    for norm in norms:
        norm(x)
    assert guard.host_checks == 1  # all three in one check
    for norm in norms:
        norm(x)
    assert guard.host_checks == 1
    with torch.no_grad():
        norms[1].weight[2] = 0.0  # in place: version counter moves
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norms[1](x)
    assert guard.host_checks == 2 and any(t is x for t in saved)  # fell back: saved its input
    assert torch.isfinite(torch.autograd.grad(y.sum(), x)[0]).all()
    norms[1].weight.data = torch.ones(8)  # through .data: no version bump...
    torch.optim.SGD(norms[1].parameters(), lr=0.0).step()  # ...but any optimizer step invalidates
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norms[1](x)
    assert guard.host_checks == 3 and not any(t is x for t in saved)


def test_gamma_guard_survives_deepcopy():
    model, _ = prepare_model(
        tiny_family("bert"), load_section(WtaCrsConfig, {"kit": {"layernorm_saves_output": True}}, "wtacrs")
    )
    clone = copy.deepcopy(model)
    (guard,), (clone_guard,) = _guards(model), _guards(clone)
    assert clone_guard is not guard
    clone_norms = {id(m) for m in clone.modules() if isinstance(m, OutputSavingLayerNorm)}
    assert {id(n) for n in clone_guard.norms} == clone_norms


PER_STEP_MODULES = ("estimator.py", "linear.py", "cache.py", "kit.py", "zero.py")


def test_host_reads_in_the_per_step_modules_are_only_the_documented_one():
    """``.tolist()``/``.item()``/``.numpy()``/``.cpu()`` appear only in ``GammaGuard._check``."""
    offenders = []
    for name in PER_STEP_MODULES:
        tree = ast.parse((Path(OURS) / name).read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr in ("tolist", "item", "numpy", "cpu"):
                    offenders.append(f"{name}:{node.lineno} {function.name}.{node.attr}")
    assert [o for o in offenders if "_check.tolist" not in o] == [], offenders
    assert any("kit.py" in o and "_check.tolist" in o for o in offenders)
