"""The LAMB step's two passes over CPU memory as two C loops, compiled on first use and called through ctypes.

A CPU optimizer step is memory-bound, so its cost is the number of parameter-sized streams it reads and writes.
The lower bound for LAMB with a per-layer trust ratio is two passes (torch's fused AdamW makes one, 7 streams):

* ``lamb_moments`` reads g, m, v, p, writes m, v, and sums ``Σw²`` and ``Σu²`` per piece
  (``u = f·m/(√v + e) + λw``, the bias corrections folded into ``f`` and ``e``) — 6 streams; with a known
  scale (no trust ratio) it also writes ``p += scale·u`` in the same pass (7 streams, AdamW's);
* ``lamb_apply`` reads m, v, p, recomputes ``u`` and writes ``p += scale·u`` — 4 streams.

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
import ctypes
import hashlib
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

/* Pieces [begin, end) of a table of k: ptrs[0..3][k] are the addresses of p, g, m, v; coef[k][2] = (f, e).
   Advances m, v with gscale·g. With scale (k floats) also p += scale·u; else sums[k][2] = (Σp², Σu²). */
CLONES void lamb_moments(int64_t begin, int64_t end, int64_t k, const int64_t *ptrs, const int64_t *numel,
                         const float *coef, float b1, float c1, float b2, float c2, float wd, const float *gscale,
                         const float *scale, double *sums) {
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
    double sw = 0.0, su = 0.0;
    for (int64_t b = 0; b < n; b += BLOCK) {
      const int64_t stop = n - b < BLOCK ? n : b + BLOCK;
      float bw = 0.0f, bu = 0.0f;
#pragma omp simd reduction(+ : bw, bu)
      for (int64_t i = b; i < stop; ++i) {
        const float g = G[i] * s, w = P[i];
        const float m = b1 * M[i] + c1 * g, v = b2 * V[i] + c2 * (g * g);
        M[i] = m;
        V[i] = v;
        const float u = DIRECTION(m, v, w);
        bw += w * w;
        bu += u * u;
      }
      sw += bw;
      su += bu;
    }
    sums[2 * c] = sw;
    sums[2 * c + 1] = su;
  }
}

/* p += scale·u over pieces [begin, end), u recomputed from the advanced m, v. */
CLONES void lamb_apply(int64_t begin, int64_t end, int64_t k, const int64_t *ptrs, const int64_t *numel,
                       const float *coef, float wd, const float *scale) {
  for (int64_t c = begin; c < end; ++c) {
    float *restrict P = (float *)ptrs[c];
    const float *restrict M = (const float *)ptrs[2 * k + c];
    const float *restrict V = (const float *)ptrs[3 * k + c];
    const float f = coef[2 * c], e = coef[2 * c + 1], a = scale[c];
    const int64_t n = numel[c];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) P[i] += a * DIRECTION(M[i], V[i], P[i]);
  }
}
"""
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno")
"""``-fno-math-errno`` lets ``sqrtf`` vectorise; ``-fopenmp-simd`` honours the simd pragmas (no OpenMP runtime)."""
MIN_PER_THREAD = 1 << 16
"""Below this many elements per thread a step runs on the calling thread (dispatch would cost more)."""

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_library: Optional[ctypes.CDLL] = None
_problem: Optional[str] = None
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


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
    lib.lamb_moments.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _F32, _F32, _F32, _F32, _PTR, _PTR, _PTR]
    lib.lamb_moments.restype = None
    lib.lamb_apply.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR]
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
    return Plan(
        tensors,
        tuple(4 * start for start in starts),
        array.array("q", sizes),
        torch.tensor(layers, dtype=torch.int64),
        tuple(sorted(set(bounds))),
        extent,
        tensors == layers == tuple(range(len(rows))) and not any(starts),
        covers_tensors,
    )


def threads() -> int:
    return max(1, torch.get_num_threads())


def _run(bounds: tuple[int, ...], call) -> None:
    """``call(begin, end)`` per thread's range; ctypes releases the GIL, so the ranges run in parallel."""
    global _pool, _pool_size
    ranges = list(zip(bounds[:-1], bounds[1:]))
    if len(ranges) <= 1:
        for begin, end in ranges:
            call(begin, end)
        return
    if _pool_size < len(ranges) - 1:
        _pool, _pool_size = ThreadPoolExecutor(len(ranges) - 1, thread_name_prefix="lamb_kernel"), len(ranges) - 1
    futures = [_pool.submit(call, begin, end) for begin, end in ranges[1:]]
    call(*ranges[0])
    for future in futures:
        future.result()


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

    def moments(self, beta1, beta2, weight_decay, gscale, scale=None) -> Optional[torch.Tensor]:
        """Advance m, v with ``gscale``·g (``gscale``: a 0-d float32 tensor or a 1-float array); return
        ``[k, 2]`` float64 (Σw², Σu²) per piece, or, given ``scale`` (k float32), also step p and return None."""
        sums = None if scale is not None else torch.empty(self.k, 2, dtype=torch.float64)
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
        )
        _run(self.plan.bounds, lambda begin, end: self.lib.lamb_moments(begin, end, *args))
        return sums

    def apply(self, weight_decay: float, scale: torch.Tensor) -> None:
        """``p += scale·u`` per piece (``scale``: k contiguous float32)."""
        args = (*self._table(), weight_decay, _address(scale))
        _run(self.plan.bounds, lambda begin, end: self.lib.lamb_apply(begin, end, *args))
