"""The CPU a benchmark ran on, in one line (bf16 is emulated without AVX512-BF16 / AMX: ~15x slower)."""

from __future__ import annotations

import os
import platform


def cpu_kind() -> str:
    """``CPU: <model name>, <n> cores available, <ISA>``, from ``/proc/cpuinfo`` (Linux)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    if {"amx_bf16", "amx_tile"} & flags:
        isa = "AMX (native bf16)"
    elif "avx512_bf16" in flags:
        isa = "AVX512-BF16 (native bf16)"
    elif "avx512f" in flags:
        isa = "AVX512 (bf16 emulated)"
    elif "avx2" in flags:
        isa = "AVX2 (bf16 emulated)"
    else:
        isa = "no AVX2"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return f"CPU: {name}, {cores} cores available, {isa}"
