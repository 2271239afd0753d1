"""Shared measurement helpers for ``bench/`` scripts (never used by tests to assert on time).

* :func:`interleaved` — A/B(/C…) timing with warm-up, variants interleaved round by round so drift
  on a noisy machine hits all of them alike; report medians.
* :func:`ratio_line` — the one-line summary every benchmark prints.
* fresh-child peak RSS and saved-for-backward bytes by category live in production code
  (``ds_bertopt.wtacrs.memory.run_in_child`` / ``measure_step_in_child`` / ``saved_tensor_bytes``).
* :func:`peak_cuda_memory` — ``torch.cuda.max_memory_allocated`` around a function (GPU peak).
* :func:`torch_ops` — the torch ops a function calls, with the shapes of their tensor-list arguments (kernel counts).
* :func:`environment` — versions, threads and machine, printed with every figure.
* :func:`record_results` — structured results for ``bench/run_all.py`` (plots and the report); :func:`record_name`
  checks the name a ``--record-as`` gives it, :class:`RecordAs` that it will be recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from typing import Any, Callable, Mapping


def interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int = 7, warmup: int = 1) -> dict[str, list[float]]:
    """Run every variant ``warmup`` times, then ``repeats`` rounds of each, interleaved.

    Returns seconds per call for each variant (warm-up excluded). A variant may return a float to
    report its own measured time (e.g. the time of the steps inside it) instead of wall time.
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(repeats):
        order = list(variants.items())
        if round_index % 2:  # alternate who goes first
            order.reverse()
        for name, fn in order:
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            times[name].append(
                float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else elapsed
            )
    return times


def median(values) -> float:
    return float(statistics.median(values))


def ratio_line(what: str, ours: list[float], theirs: list[float], baseline_name: str) -> str:
    """``"<what> vs <baseline>: 0.83x (median of 7)"`` — ours/theirs of the medians."""
    ratio = median(ours) / median(theirs)
    return f"{what} vs {baseline_name}: {ratio:.2f}x (median of {min(len(ours), len(theirs))})"


def peak_cuda_memory(fn: Callable, *args, **kwargs):
    """Run ``fn`` on the current CUDA device; return ``(result, peak_allocated_bytes)`` over the call."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return result, int(torch.cuda.max_memory_allocated())


VIEW_OPS = frozenset({"detach", "view", "select", "unbind", "alias", "lift_fresh", "_unsafe_view", "slice", "narrow"})
"""Ops that make views or wrap a value: no kernel runs."""


def torch_ops(fn: Callable[[], Any]) -> list[tuple[str, list]]:
    """``(op name, [shapes of each tensor-list argument])`` of every torch op ``fn`` calls, in order, as a dispatch
    mode sees them: each op once (what runs inside an op is not seen), the same ops on every device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            lists = [
                [tuple(t.shape) for t in a]
                for a in args
                if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)
            ]
            ops.append((func.overloadpacket.__name__, lists))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return ops


RECORD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A record is one file in the report's raw directory: no separators, no leading dot (``.name.json.tmp`` is ours)."""


def record_name(name: str) -> str:
    """``name`` if it can name a record, else :class:`argparse.ArgumentTypeError` (a ``--record-as`` option's
    ``type``: the run is refused before it measures, not after)."""
    if not RECORD_NAME.fullmatch(name) or name.endswith(".json"):
        raise argparse.ArgumentTypeError(
            f"record name {name!r}: letters, digits, '_', '-' and '.' only, starting with a letter or digit, "
            "without '.json' (it names bench/report/raw/<name>.json)"
        )
    return name


OUT_ENV = "DS_BERTOPT_BENCH_OUT"
"""The raw directory records go to (``bench/run_all.py`` sets it); unset, nothing is recorded."""


class RecordAs(argparse.Action):
    """A ``--record-as`` given on the command line where :data:`OUT_ENV` is unset is refused in one line, before the
    bench measures: nothing would be recorded, and that would show only after the run (defaults are not checked:
    smoke runs record nothing on purpose)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not os.environ.get(OUT_ENV):
            parser.error(
                f"{option_string} {values}: nothing is recorded while {OUT_ENV} is unset (bench/run_all.py sets it; "
                f"by hand: {OUT_ENV}=bench/report/raw)"
            )
        setattr(namespace, self.dest, values)


def record_results(name: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` (JSON-able) to ``$DS_BERTOPT_BENCH_OUT/<name>.json`` when run by ``bench/run_all.py``.

    Benchmarks call this with the numbers behind their printed lines; the report and its plots are
    generated from these files, never typed in. A no-op when the variable is unset; a ``name`` that
    :func:`record_name` refuses raises, set or not.
    """
    record_name(name)
    out_dir = os.environ.get(OUT_ENV)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    record = {"name": name, "environment": environment(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    tmp = os.path.join(out_dir, f".{name}.json.tmp")
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=1, default=float)
    os.replace(tmp, os.path.join(out_dir, f"{name}.json"))


def environment() -> dict[str, Any]:
    """Versions and machine facts to print next to every figure."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
    }
    for module in ("torch", "deepspeed", "transformers", "datasets"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - report what is missing, do not fail the benchmark
            info[module] = "missing"
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        pass
    return info


def environment_line() -> str:
    return "env: " + json.dumps(environment(), sort_keys=True)
