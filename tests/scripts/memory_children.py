"""Children for ``tests/test_memory_children.py``: steps that run out of memory or die, for real (no torch: a
child imports only this and ``ds_bertopt.wtacrs.child``)."""

from __future__ import annotations

import os
import resource
import signal

MiB = 1 << 20
PER_EXAMPLE = 8 * MiB


def _limit_address_space(extra: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra`` bytes (RLIMIT_AS)."""
    with open("/proc/self/status") as fh:
        size_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmSize:"))
    limit = size_kib * 1024 + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def step(batch: int, fits_up_to: int) -> dict:
    """A "training step" whose peak grows with ``batch`` (:data:`PER_EXAMPLE` bytes per example): up to
    ``fits_up_to`` it fits this process's memory limit; above, its allocation fails under RLIMIT_AS, as a step too
    big for the device fails."""
    _limit_address_space(fits_up_to * PER_EXAMPLE + PER_EXAMPLE // 2)
    held = bytearray(batch * PER_EXAMPLE)
    return {"step_peak": len(held), "step_s": 0.01}


def environment(*names: str) -> dict:
    """What this child sees of ``names`` in its environment."""
    return {name: os.environ.get(name) for name in names}


def fork_servers() -> list[int]:
    """The pids of this process's fork servers (its children running ``multiprocessing.forkserver``'s main)."""
    servers = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                command = fh.read()
        except OSError:  # gone meanwhile
            continue
        if parent == os.getpid() and b"multiprocessing.forkserver import main" in command:
            servers.append(int(entry.name))
    return servers


def killed() -> None:
    """Dies as the kernel's out-of-memory killer kills: SIGKILL, no word to the parent."""
    os.kill(os.getpid(), signal.SIGKILL)


def exits(status: int) -> None:
    os._exit(status)


def crashes() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)
