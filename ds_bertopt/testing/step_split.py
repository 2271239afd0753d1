"""Where a training step's time goes: GEMMs, attention, and the rest, from ``torch.profiler`` op names.

:func:`split_step` reads the events of one profiled step (``prof.events()``) and adds up each operator's *self*
time (host time on CPU, the kernels' device time on CUDA) into three parts:

* ``attention``: every op run inside an attention call (``scaled_dot_product_attention``, flash / varlen kernels,
  our ``ds_bertopt::packed_attention``), *and* the backward of those ops. A backward op is found through the
  autograd node that runs it (``autograd::engine::evaluate_function: …``), whose ``sequence_nr`` is the one of the
  forward op that created it: SDPA's math path on CPU is composite, so its backward is plain ``bmm`` / ``mul`` /
  softmax-backward nodes that only this link tells apart from the encoder's own;
* ``gemm``: matrix multiplies outside attention (``mm``, ``addmm``, ``bmm``, oneDNN / MKL linears);
* ``rest``: everything else (dropout, LayerNorm, GELU, adds, copies, casts, embeddings, the loss), plus, when the
  step's wall time is given, the host time no op accounts for (Python, dispatch): ``rest = wall - gemm - attention``.
  Under ``torch.compile`` on a CPU, Inductor's fused kernels (``cpp_fused_*``) are no profiler events (unless
  ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``), so their time reaches ``rest`` through that remainder; its matrix
  multiplies stay ``aten::mm`` / ``addmm`` (extern kernels), and the attention ops keep their names.

Used by ``bench/mfu.py``; tested on a real profile in ``tests/test_fused.py``.
"""

from __future__ import annotations

from typing import Iterable, Optional

GEMM_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "aten::_addmm_activation",
        "aten::mkldnn_linear",
        "aten::_mkl_linear",
        "mkldnn::_linear_pointwise",
    }
)
"""Operators whose self time is a matrix multiply (composites such as ``aten::linear``/``matmul`` add only their
own dispatch time, which counts as ``rest``)."""
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "varlen_attn", "packed_attention", "efficient_attention")
"""Substrings of the names of attention calls (forward ops, fused backward ops, autograd nodes)."""
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def is_attention(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in ATTENTION_MARKERS)


def _self_time_us(event, device: bool) -> float:
    if device:
        return float(getattr(event, "self_device_time_total", 0.0) or 0.0)
    return float(event.self_cpu_time_total)


def split_step(events: Iterable, wall_s: Optional[float] = None, device: bool = False) -> dict[str, float]:
    """``{"gemm", "attention", "rest", "total"}`` in seconds for the profiled ops ``events`` (``prof.events()``);
    ``device``: count the kernels' device time (CUDA) instead of host time. With ``wall_s`` (the step's wall time,
    host-timed), ``rest`` is ``wall_s - gemm - attention`` and ``total`` is ``wall_s``."""
    events = [e for e in events if getattr(e, "device_type", None) is None or "CPU" in str(e.device_type)]
    attention_seq: set[int] = set()
    inside: dict[int, bool] = {}

    def under_attention(event) -> bool:
        key = id(event)
        if key not in inside:
            parent = event.cpu_parent
            name = event.name
            if is_attention(name):
                inside[key] = True
            elif name.startswith(BACKWARD_PREFIX):
                inside[key] = event.sequence_nr in attention_seq
            else:
                inside[key] = parent is not None and under_attention(parent)
        return inside[key]

    # forward ops first: their sequence numbers mark which backward nodes are attention's
    ordered = sorted(events, key=lambda e: e.time_range.start)
    for event in ordered:
        if not event.name.startswith(BACKWARD_PREFIX) and event.sequence_nr >= 0 and under_attention(event):
            attention_seq.add(event.sequence_nr)
    inside.clear()
    parts = {"gemm": 0.0, "attention": 0.0, "rest": 0.0}
    for event in ordered:
        seconds = _self_time_us(event, device) * 1e-6
        if under_attention(event):
            parts["attention"] += seconds
        elif event.name in GEMM_OPS:
            parts["gemm"] += seconds
        else:
            parts["rest"] += seconds
    if wall_s is not None:
        parts["rest"] = max(0.0, wall_s - parts["gemm"] - parts["attention"])
    parts["total"] = parts["gemm"] + parts["attention"] + parts["rest"]
    return parts


def top_ops(events: Iterable, count: int = 12, device: bool = False) -> list[tuple[str, float]]:
    """The ``count`` operators with the most self time (seconds), for a printed profile."""
    totals: dict[str, float] = {}
    for event in events:
        totals[event.name] = totals.get(event.name, 0.0) + _self_time_us(event, device) * 1e-6
    return sorted(totals.items(), key=lambda kv: -kv[1])[:count]


__all__ = ["ATTENTION_MARKERS", "GEMM_OPS", "is_attention", "split_step", "top_ops"]
