"""Host-sync recorder: ``torch.cuda.set_sync_debug_mode("warn")`` turned into counted, attributed events."""

import collections
import contextlib
import functools
import importlib.util
import os
import sys
import tempfile
import traceback
import warnings
from typing import Optional

from .runner import ENTRY, Ctx

SYNC_MARK = "synchronizing cuda operation"  # c10::cuda::warn_or_error_on_sync's message, lower-cased
DOCUMENTED_SYNCS = (
    # (file under ds_bertopt, function, text of the source line or None): the syncs the code documents
    ("train/loop.py", "result", "self.event.synchronize()"),  # the stop vote's event, a step old: waits for it alone
    ("train/loop.py", "train_step", "engine.step("),  # the non-finite verdict (DeepSpeed's overflow check)
    ("train/loop.py", "train_step", "was_step_applied"),
    ("train/nonfinite.py", None, None),  # our finite-gradient guard (fp32, ZeRO 0)
    ("wtacrs/kit.py", "_check", None),  # GammaGuard's γ check: once per optimizer step
)


@functools.cache
def _package_roots() -> list:
    """``[(directory, package)]`` of the packages a sync is attributed to, longest directory first (a venv
    inside a checkout called ``ds_bertopt`` still attributes torch's files to torch)."""
    roots = []
    for package in ("ds_bertopt", "deepspeed", "transformers", "peft", "accelerate", "torch"):
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(package)
            for location in (spec.submodule_search_locations or []) if spec else []:
                roots.append((os.path.realpath(location) + os.sep, package))
    return sorted(roots, key=lambda entry: -len(entry[0]))


def _locate(filename: str) -> tuple:
    """(package or "other", path inside it) of a source file."""
    real = os.path.realpath(filename)
    for root, package in _package_roots():
        if real.startswith(root):
            return package, real[len(root) :].replace(os.sep, "/")
    return "other", os.path.basename(filename)


def _short(frame) -> str:
    package, rel = _locate(frame.filename)
    return f"{package + '/' if package != 'other' else ''}{rel}:{frame.lineno} {frame.name}"


def _gpu_check(filename: str) -> bool:
    """A frame of gpu_check itself (the recorder, the patched ``train_step``), never a sync's site."""
    real = os.path.realpath(filename)
    return real.startswith(os.path.dirname(os.path.realpath(__file__)) + os.sep) or real == os.path.realpath(ENTRY)


def attribute(frames) -> dict:
    """Where a sync came from: the innermost frame outside torch (and gpu_check), and the innermost
    ds_bertopt frame; ``documented`` when that frame is one of :data:`DOCUMENTED_SYNCS`."""
    frames = [f for f in frames if not f.filename.endswith("warnings.py") and not _gpu_check(f.filename)]
    located = [(f, *_locate(f.filename)) for f in frames]
    if not located:
        return {"site": "unknown", "owner": "unknown", "documented": False, "ours_top": [], "line": ""}
    inner = ([entry for entry in located if entry[1] != "torch"] or located)[-1]
    ours = [entry for entry in located if entry[1] == "ds_bertopt"]
    site, documented = _short(inner[0]), False
    if ours:
        frame, _, rel = ours[-1]
        documented = any(
            rel == path and function in (None, frame.name) and (text is None or text in (frame.line or ""))
            for path, function, text in DOCUMENTED_SYNCS
        )
        site += f" (from {_short(frame)})" if ours[-1] is not inner else ""
    return {
        "site": site,
        "owner": inner[1],
        "documented": documented,
        "ours_top": [_short(entry[0]) for entry in ours[-3:]][::-1],
        "line": (inner[0].line or "").strip()[:120],
    }


class SyncRecorder:
    """Counts CUDA host syncs between :meth:`start` and :meth:`stop`.

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call raise a C++ warning
    (``c10::cuda::warn_or_error_on_sync``, from ``memcpy_and_sync`` / ``stream_synchronize`` /
    ``device_synchronize``); torch hands warnings raised under a Python call to ``warnings`` (autograd
    replays its worker threads' warnings at the ``backward()`` call), where a ``showwarning`` hook takes
    the Python stack. A warning raised where no Python handler is active is printed by c10 to stderr:
    fd 2 is captured meanwhile and such lines are counted as unattributed.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list = []
        self.unattributed = 0
        self.step: Optional[int] = None
        self.active = False

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MARK in str(message).lower():
            self.events.append({"step": self.step, **attribute(traceback.extract_stack()[:-1])})
        else:
            self._previous_show(message, category, filename, lineno, file, line)

    def _debug_mode(self, mode: str) -> None:
        import torch

        if self.cuda and mode == "warn":
            torch.cuda.synchronize()  # the work queued before the start is not counted
        if self.cuda:
            torch.cuda.set_sync_debug_mode(mode)

    def start(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._previous_show, warnings.showwarning = warnings.showwarning, self._show
        sys.stderr.flush()
        self._saved_fd, self._capture = os.dup(2), tempfile.TemporaryFile()
        os.dup2(self._capture.fileno(), 2)
        self._debug_mode("warn")
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        self._debug_mode("default")
        self.active = False
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._capture.seek(0)
        lines = self._capture.read().decode(errors="replace").splitlines()
        self._capture.close()
        self._warnings.__exit__(None, None, None)
        self.unattributed = sum(SYNC_MARK in line.lower() for line in lines)
        rest = "\n".join(line for line in lines if SYNC_MARK not in line.lower())
        if rest.strip():
            sys.stderr.write(rest + "\n")

    def summary(self, steps: int) -> dict:
        sites: dict = {}
        for event in self.events:
            fields = {k: event[k] for k in ("owner", "documented", "ours_top", "line")}
            sites.setdefault(event["site"], {**fields, "count": 0})["count"] += 1
        per_step = collections.Counter(event["step"] for event in self.events)
        return dict(steps=steps, total=len(self.events), unattributed=self.unattributed, sites=sites, per_step=per_step)


def describe_syncs(ctx: Ctx, label: str, summary: dict) -> tuple:
    """Print a run's syncs; return (syncs per step, undocumented syncs per step in ds_bertopt code)."""
    steps, unattributed, ours_undocumented = max(1, summary["steps"]), summary["unattributed"], 0.0
    total = summary["total"] + unattributed
    counts = {int(step): n for step, n in summary["per_step"].items() if str(step).lstrip("-").isdigit()}
    per_step = [counts[step] for step in sorted(counts)]
    ctx.detail(
        f"{label}: {total / steps:.2f} syncs per step over {steps} steps (per step {per_step or [0]})"
        + (f", {unattributed} unattributed (C++ warning on stderr)" if unattributed else "")
    )
    for site, entry in sorted(summary["sites"].items(), key=lambda kv: -kv[1]["count"]):
        ours = entry["owner"] == "ds_bertopt"
        internal = "" if ours else f"{entry['owner']}-internal"
        kind = ", ".join(x for x in ("documented" if entry["documented"] else "", internal) if x)
        kind = kind or "ours, NOT documented"
        if ours and not entry["documented"]:
            ours_undocumented += entry["count"] / steps
        ctx.detail(f"    {entry['count'] / steps:.2f}/step [{kind}] {site}: {entry['line']}")
        if entry["ours_top"] and not ours:
            ctx.detail(f"        ds_bertopt frames: {' <- '.join(entry['ours_top'])}")
    return total / steps, ours_undocumented
