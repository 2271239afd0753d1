"""The LAMB step's two passes over CPU memory as two C loops, compiled on first use and called through ctypes.

A CPU optimizer step is memory-bound, so its cost is the number of parameter-sized streams it reads and writes.
The lower bound for LAMB with a per-layer trust ratio is two passes (torch's fused AdamW makes one, 7 streams):

* ``lamb_moments`` reads g, m, v, p, writes m, v, and sums ``Σw²`` and ``Σu²`` per piece
  (``u = f·m/(√v + e) + λw``, the bias corrections folded into ``f`` and ``e``) — 6 streams; with a known
  scale (no trust ratio) it also writes ``p += scale·u`` in the same pass (7 streams, AdamW's);
* ``lamb_apply`` reads m, v, p, recomputes ``u`` and writes ``p += scale·u`` — 4 streams.

Where nothing is all-reduced (no ZeRO split) and a piece is its whole layer, its ratio is known when its first pass
ends: ``lamb_moments`` takes it there and runs the second pass over the piece at once, while its p, m, v are still
in cache. A layer whose state fits in the last-level cache then costs one pass over memory (7 streams, AdamW's);
only larger layers and split ones pay the second (:func:`traffic`).

A *piece* is a contiguous fp32 run of one held tensor (a whole tensor, a ZeRO fragment, or a part of one for
threading); one call covers any number of pieces, so the per-tensor cost is a table row, not a Python call. The
scalars that change every step (the clip factor, the per-piece ``-lr·ratio``) are read from tensors, so nothing
is read back on the host. Sums are accumulated in fp32 over blocks of 1,024 elements, then in double.

Built with the system C compiler (``$CC``, else ``cc``) into ``$TMPDIR/ds_bertopt_kernels_<uid>/`` (keyed by
the source, compiler and flags; built once per machine in ~0.4 s, loaded by later processes in ~1 ms), with
x86-64-v3/v4 clones chosen at load time.
Without a compiler, or on a failed build, :func:`library` returns None and LAMB takes its foreach path.
"""

from __future__ import annotations

import array
import collections
import ctypes
import hashlib
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..log import print0

SOURCE = r"""
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define BLOCK 1024
/* LAMB's direction u = λw + f·m/(√v + e), in the order the foreach path computes it. */
#define DIRECTION(m, v, p) (wd * (p) + f * ((m) / (sqrtf(v) + e)))

/* p += a·u over one piece, u recomputed from the advanced m, v. */
static inline void apply_piece(float *restrict P, const float *restrict M, const float *restrict V, int64_t n,
                               float f, float e, float wd, float a) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) P[i] += a * DIRECTION(M[i], V[i], P[i]);
}

/* The rule of lamb.trust_ratios (‖w‖/‖u‖, clamped to [lo, hi] where computed, 1 where a norm is 0) times −lr,
   rounded to fp32 as the two-pass step rounds (ratios * -lr).to(float32); NaN stays NaN as torch.clamp keeps it. */
static inline float scale_of(double sw, double su, const double *fuse) {
  double r = 1.0;
  if (sw > 0.0 && su > 0.0) {
    r = sqrt(sw / su);
    if (r < fuse[1]) r = fuse[1];
    if (r > fuse[2]) r = fuse[2];
  }
  return (float)(r * fuse[0]);
}

/* The first pass over piece [0, n): advance m, v; (Σw², Σu²) summed in fp32 blocks, then in double; u kept in
   U[i] when STORE. */
#define SWEEP(STORE)                                                         \
  for (int64_t b = 0; b < n; b += BLOCK) {                                   \
    const int64_t stop = n - b < BLOCK ? n : b + BLOCK;                      \
    float bw = 0.0f, bu = 0.0f;                                              \
    _Pragma("omp simd reduction(+ : bw, bu)") for (int64_t i = b; i < stop; ++i) { \
      const float g = G[i] * s, w = P[i];                                    \
      const float m = b1 * M[i] + c1 * g, v = b2 * V[i] + c2 * (g * g);      \
      M[i] = m;                                                              \
      V[i] = v;                                                              \
      const float u = DIRECTION(m, v, w);                                    \
      STORE;                                                                 \
      bw += w * w;                                                           \
      bu += u * u;                                                           \
    }                                                                        \
    sw += bw;                                                                \
    su += bu;                                                                \
  }

/* Pieces [begin, end) of a table of k: ptrs[0..3][k] are the addresses of p, g, m, v; coef[k][2] = (f, e).
   Advances m, v with gscale·g. With scale (k floats) also p += scale·u; else sums[k][2] = (Σp², Σu²), and where
   alone[c] (the piece is its layer, nothing to all-reduce) and fuse = (−lr, lo, hi) are given, the ratio is taken
   and the piece stepped at once: its p, m, v are still in cache, so a layer that fits costs one pass over memory.
   A stepped piece of at most work_len elements keeps u in work (this thread's), so that its second pass is
   p += a·u from cache rather than a second √ and division per element. */
CLONES void lamb_moments(int64_t begin, int64_t end, int64_t k, const int64_t *ptrs, const int64_t *numel,
                         const float *coef, float b1, float c1, float b2, float c2, float wd, const float *gscale,
                         const float *scale, double *sums, const int8_t *alone, const double *fuse,
                         float *work, int64_t work_len) {
  const float s = *gscale;
  for (int64_t c = begin; c < end; ++c) {
    float *restrict P = (float *)ptrs[c];
    const float *restrict G = (const float *)ptrs[k + c];
    float *restrict M = (float *)ptrs[2 * k + c];
    float *restrict V = (float *)ptrs[3 * k + c];
    const float f = coef[2 * c], e = coef[2 * c + 1];
    const int64_t n = numel[c];
    if (scale) {
      const float a = scale[c];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = G[i] * s;
        const float m = b1 * M[i] + c1 * g, v = b2 * V[i] + c2 * (g * g);
        M[i] = m;
        V[i] = v;
        P[i] += a * DIRECTION(m, v, P[i]);
      }
      continue;
    }
    const int step = fuse && alone && alone[c];
    float *restrict U = step && work && n <= work_len ? work : 0;
    double sw = 0.0, su = 0.0;
    if (U) {
      SWEEP(U[i] = u)
    } else {
      SWEEP((void)0)
    }
    sums[2 * c] = sw;
    sums[2 * c + 1] = su;
    if (!step) continue;
    const float a = scale_of(sw, su, fuse);
    if (U) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) P[i] += a * U[i];
    } else {
      apply_piece(P, M, V, n, f, e, wd, a);
    }
  }
}

/* p += scale·u over pieces [begin, end), u recomputed from the advanced m, v; pieces marked alone are skipped
   (lamb_moments stepped them). */
CLONES void lamb_apply(int64_t begin, int64_t end, int64_t k, const int64_t *ptrs, const int64_t *numel,
                       const float *coef, float wd, const float *scale, const int8_t *alone) {
  for (int64_t c = begin; c < end; ++c) {
    if (alone && alone[c]) continue;
    apply_piece((float *)ptrs[c], (const float *)ptrs[2 * k + c], (const float *)ptrs[3 * k + c], numel[c],
                coef[2 * c], coef[2 * c + 1], wd, scale[c]);
  }
}
"""
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno")
"""``-fno-math-errno`` lets ``sqrtf`` vectorise; ``-fopenmp-simd`` honours the simd pragmas (no OpenMP runtime)."""
MIN_PER_THREAD = 1 << 16
"""Below this many elements per thread a step runs on the calling thread (dispatch would cost more)."""
WORK_LIMIT = 1 << 20
"""Largest piece (elements) whose direction is kept between its two passes (4 MiB a thread: a larger layer's
state leaves the cache anyway, and its second pass recomputes u as it streams p, m, v back)."""

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_library: Optional[ctypes.CDLL] = None
_problem: Optional[str] = None
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_work: list = []
"""Per thread range, the float32 buffer that holds a piece's direction between its passes (kept across steps: a
fresh allocation of this size page-faults every step)."""


def _cache_dir() -> Path:
    """A directory only this user can write (a shared one would let another user plant the library)."""
    path = Path(tempfile.gettempdir()) / f"ds_bertopt_kernels_{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{path} is not private to this user")
    return path


def _build() -> ctypes.CDLL:
    if os.name != "posix":
        raise OSError("built only on POSIX systems")
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        raise OSError("no C compiler (cc/gcc) on PATH and $CC unset")
    key = hashlib.sha256("\0".join([SOURCE, *compiler, *FLAGS, platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"lamb_{key}.so"
    if not target.exists():  # build beside it, then rename: ranks building at once each get a whole file
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
        os.close(fd)
        try:
            proc = subprocess.run(
                [*compiler, *FLAGS, "-x", "c", "-", "-o", partial],
                input=SOURCE,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if proc.returncode != 0:
                raise OSError(f"{compiler[0]} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    lib = ctypes.CDLL(str(target))
    lib.lamb_moments.argtypes = [_I64, _I64, _I64, *[_PTR] * 3, *[_F32] * 5, *[_PTR] * 6, _I64]
    lib.lamb_moments.restype = None
    lib.lamb_apply.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR, _PTR]
    lib.lamb_apply.restype = None
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on the first call; None (said once) when it cannot be built here."""
    global _library, _problem
    if _library is None and _problem is None:
        try:
            _library = _build()
        except (OSError, AttributeError, subprocess.SubprocessError) as exc:  # AttributeError: a symbol missing
            _problem = str(exc) or type(exc).__name__
            print0(f"LAMB: the fused CPU kernel is unavailable ({_problem}); using the foreach path")
    return _library


def unavailable_reason() -> Optional[str]:
    """Why :func:`library` returned None (None while it has not been tried or succeeded)."""
    return _problem


def addresses(params, grads, exp_avgs, exp_avg_sqs) -> Optional[list[int]]:
    """The data addresses ``[p…, g…, m…, v…]`` when the kernel can step these tensors (contiguous fp32 on the CPU,
    each row of one size), else None. Checked every step: the C loops trust it (a bf16 or strided tensor would be
    read out of bounds)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        return None
    sizes = [p.numel() for p in params]
    found, f32 = [], torch.float32
    for tensors in lists:
        for t, n in zip(tensors, sizes):
            if t is None or t.dtype is not f32 or not t.is_cpu or not t.is_contiguous() or t.numel() != n:
                return None
            found.append(t.data_ptr())
    return found


@dataclass(frozen=True)
class Plan:
    """The pieces one call covers, one row per piece, and how they are split over threads."""

    tensor: tuple[int, ...]
    """Index of the held tensor each piece lies in."""
    offset: tuple[int, ...]
    """Byte offset of the piece in its tensor."""
    numel: array.array
    """Elements per piece (int64, read by the kernel)."""
    layer: torch.Tensor
    """Layer of each piece (int64 tensor: the per-layer sums and scales are gathered with it)."""
    bounds: tuple[int, ...]
    """Thread ``j`` steps pieces ``bounds[j] … bounds[j + 1] − 1``."""
    extent: dict
    """Per held tensor, the end of its last piece (elements): checked against the tensors of every step."""
    whole: bool
    """Piece ``i`` is held tensor ``i`` from its start and layer ``i`` (no address arithmetic, no gathers)."""
    alone: array.array
    """Per piece (int8): 1 where the piece is the only one of its layer here, so that, with nothing to all-reduce,
    its ratio is known when its first pass ends and its second pass runs while its state is still in cache."""
    largest_alone: int
    """Elements of the largest such piece (0: none)."""
    covers_tensors: bool = False
    """Every piece ends where its held tensor does (checked at every step); otherwise a piece may end earlier (a ZeRO
    shard's last real element before its alignment padding)."""


def plan(fragments: Sequence[tuple[int, int, int, int]], threads: int, covers_tensors: bool = False) -> Plan:
    """Pieces from ``(tensor, start, numel, layer)`` fragments; split for ``threads`` when there is enough work.
    ``covers_tensors``: each fragment is its whole held tensor."""
    extent: dict = {}
    for tensor, start, numel, _ in fragments:
        if tensor < 0 or start < 0 or numel < 0:
            raise ValueError(f"fragment ({tensor}, {start}, {numel}): negative index, start or size")
        extent[tensor] = max(extent.get(tensor, 0), start + numel)
    total = sum(f[2] for f in fragments)
    if threads > 1 and total >= threads * MIN_PER_THREAD:
        size = -(-total // (4 * threads) // 16) * 16  # a few pieces per thread, 64-byte aligned
        rows = [
            (tensor, start + at, min(size, numel - at), layer)
            for tensor, start, numel, layer in fragments
            for at in range(0, numel, size)
        ]
        bounds, done = [0], 0
        for i, row in enumerate(rows):
            done += row[2]
            if done * threads >= total * len(bounds) and len(bounds) < threads:
                bounds.append(i + 1)
        bounds.append(len(rows))
    else:
        rows, bounds = list(fragments), [0, len(fragments)]
    tensors, starts, sizes, layers = (tuple(column) for column in zip(*rows)) if rows else ((), (), (), ())
    pieces_of = collections.Counter(layers)
    return Plan(
        tensors,
        tuple(4 * start for start in starts),
        array.array("q", sizes),
        torch.tensor(layers, dtype=torch.int64),
        tuple(sorted(set(bounds))),
        extent,
        tensors == layers == tuple(range(len(rows))) and not any(starts),
        array.array("b", [pieces_of[layer] == 1 for layer in layers]),
        max((n for n, layer in zip(sizes, layers) if pieces_of[layer] == 1), default=0),
        covers_tensors,
    )


ADAMW_BYTES = 28
"""Bytes per fp32 element a one-pass fused AdamW moves: reads p, g, m, v, writes p, m, v."""
TWO_PASS_BYTES = 40
"""Bytes per element of the two passes: 24 for the first (reads g, m, v, p, writes m, v), 16 for the second."""


def traffic(layer_sizes: Sequence[int], cache_bytes: int) -> float:
    """Bytes per element the fused step moves to and from memory over whole fp32 layers with the trust ratio,
    nothing all-reduced, one thread: a layer whose p, m, v (12 B an element) fit in ``cache_bytes`` is re-read from
    cache by its second pass (:data:`ADAMW_BYTES`), a larger one from memory (:data:`TWO_PASS_BYTES`)."""
    total = sum(layer_sizes)
    if not total:
        return 0.0
    cached = sum(n for n in layer_sizes if 12 * n <= cache_bytes)
    return (ADAMW_BYTES * cached + TWO_PASS_BYTES * (total - cached)) / total


def threads() -> int:
    return max(1, torch.get_num_threads())


def _run(bounds: tuple[int, ...], call) -> None:
    """``call(j, begin, end)`` per thread's range ``j``; ctypes releases the GIL, so the ranges run in parallel."""
    global _pool, _pool_size
    ranges = [(j, begin, end) for j, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:]))]
    if len(ranges) <= 1:
        for j, begin, end in ranges:
            call(j, begin, end)
        return
    if _pool_size < len(ranges) - 1:
        _pool, _pool_size = ThreadPoolExecutor(len(ranges) - 1, thread_name_prefix="lamb_kernel"), len(ranges) - 1
    futures = [_pool.submit(call, *r) for r in ranges[1:]]
    call(*ranges[0])
    for future in futures:
        future.result()


def _work_buffers(count: int, size: int) -> list[int]:
    """Addresses of ``count`` float32 buffers of at least ``size`` elements, one per thread range."""
    for j in range(count):
        if j == len(_work):
            _work.append(torch.empty(0))
        if _work[j].numel() < size:
            _work[j] = torch.empty(size, dtype=torch.float32)
    return [_work[j].data_ptr() for j in range(count)]


def _address(buffer) -> int:
    return buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer.buffer_info()[0]


class Step:
    """One group's step: the piece table with this step's addresses, then the two passes. Small tables are
    ``array`` objects (building them as tensors from lists costs more than the kernel on small models)."""

    def __init__(self, pieces: Plan, tensors: tuple, found: list[int], coefficients: Sequence[tuple]):
        """``tensors``: (params, grads, exp_avgs, exp_avg_sqs), ``found`` their :func:`addresses`;
        ``coefficients``: ``(f, e)`` per held tensor, ``u = f·m/(√v + e) + λw``."""
        n = len(tensors[0])
        for tensor, end in pieces.extent.items():
            size = tensors[0][tensor].numel() if tensor < n else -1
            if end > size or (pieces.covers_tensors and end != size):
                raise ValueError(f"LAMB layout: a fragment ends at element {end} of held tensor {tensor} of {size}")
        self.plan, self.k, self.lib = pieces, len(pieces.tensor), library()
        self.fused = False  # the last moments() stepped the pieces that are alone in their layer
        self.tensors = tensors  # the addresses stay valid while the step lives
        if pieces.whole:
            self.ptrs = array.array("q", found)  # [4][k]: p, g, m, v
        else:
            self.ptrs = array.array(
                "q",
                [found[j * n + i] + offset for j in range(4) for i, offset in zip(pieces.tensor, pieces.offset)],
            )
        if len(set(coefficients)) == 1:
            self.coef = array.array("f", coefficients[0] * self.k)
        else:
            self.coef = array.array("f", [x for i in pieces.tensor for x in coefficients[i]])

    def _table(self) -> tuple:
        return self.k, self.ptrs.buffer_info()[0], self.plan.numel.buffer_info()[0], self.coef.buffer_info()[0]

    def moments(self, beta1, beta2, weight_decay, gscale, scale=None, fuse=None) -> Optional[torch.Tensor]:
        """Advance m, v with ``gscale``·g (``gscale``: a 0-d float32 tensor or a 1-float array); return
        ``[k, 2]`` float64 (Σw², Σu²) per piece, or, given ``scale`` (k float32), also step p and return None.
        ``fuse = (lr, min_ratio, max_ratio)`` (the clamps None or floats): also step every piece that is alone in
        its layer (:attr:`Plan.alone`), with its ratio, before leaving it; only for layers not all-reduced."""
        sums = None if scale is not None else torch.empty(self.k, 2, dtype=torch.float64)
        fused = None
        if fuse is not None and scale is None:
            lr, low, high = fuse
            fused = array.array("d", [-lr, -math.inf if low is None else low, math.inf if high is None else high])
        self.fused = fused is not None
        args = (
            *self._table(),
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            weight_decay,
            _address(gscale),
            None if scale is None else _address(scale),
            None if sums is None else sums.data_ptr(),
            self.plan.alone.buffer_info()[0] if fused is not None else None,
            None if fused is None else fused.buffer_info()[0],
        )
        size = min(WORK_LIMIT, self.plan.largest_alone) if fused is not None else 0
        work = _work_buffers(len(self.plan.bounds) - 1, size) if size else None

        def call(j: int, begin: int, end: int) -> None:
            self.lib.lamb_moments(begin, end, *args, None if work is None else work[j], size)

        _run(self.plan.bounds, call)
        return sums

    @property
    def pending(self) -> bool:
        """Pieces remain for :meth:`apply` after the last :meth:`moments`."""
        return not self.fused or not all(self.plan.alone)

    def apply(self, weight_decay: float, scale: torch.Tensor) -> None:
        """``p += scale·u`` per piece (``scale``: k contiguous float32) not already stepped by :meth:`moments`."""
        alone = self.plan.alone.buffer_info()[0] if self.fused else None
        args = (*self._table(), weight_decay, _address(scale), alone)
        _run(self.plan.bounds, lambda j, begin, end: self.lib.lamb_apply(begin, end, *args))
