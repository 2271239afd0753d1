"""Stale locks of torch's JIT extension builds, found and removed before they hang a run.

DeepSpeed builds its ops on first use with ``torch.utils.cpp_extension.load`` (on CPU every process group builds
``deepspeed_shm_comm``: ``deepspeed.comm.torch.build_shm_op``; offload builds ``cpu_adam``). torch serialises the
build with a ``FileBaton`` (``torch.utils.file_baton``): the builder creates ``<build dir>/lock`` with ``O_EXCL``,
keeps it open while it builds and deletes it after; every other process polls until the file is gone, with no
timeout. A builder that is killed (Ctrl-C through the launcher, a rank killed after its peer failed, a test timeout)
leaves the file behind, and every later run on that machine waits forever before its first collective.

A lock that no live process holds open is such a leftover: the holder keeps its descriptor for the whole build.
But ``/proc`` shows this machine's processes only, and the lock file tells nothing else: ``FileBaton.try_acquire``
(torch/utils/file_baton.py) creates it with ``os.open(path, os.O_CREAT | os.O_EXCL)`` and writes nothing, no host,
no pid (``torch.utils.cpp_extension._jit_compile`` holds it as ``FileBaton(os.path.join(build_directory,
'lock'))``). So a lock is removed only where this machine's processes are the only ones that can hold it: on a
filesystem only this kernel serves (:data:`ds_bertopt.mounts.LOCAL_TYPES`) and not on a bind mount of a folder (a
container volume). A lock in a folder other hosts or containers may see (an NFS or Lustre home, a shared
``TORCH_EXTENSIONS_DIR``) is named in one line and left alone, and so is a lock with content (not FileBaton's).
"""

from __future__ import annotations

import glob
import os
import sys

from ds_bertopt.log import print_all
from ds_bertopt.mounts import Mount, mount_of, seen_by_others

LOCK_NAME = "lock"


def extensions_root() -> str:
    """The folder torch builds JIT extensions under (``torch.utils.cpp_extension._get_build_directory``'s parent,
    computed the same way without creating anything)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def stale_locks(locks: dict[str, tuple[int, int]], held: set[tuple[int, int]]) -> list[str]:
    """The lock paths (path -> (device, inode)) whose file no live process holds open (``held``: their (device,
    inode) pairs), in path order."""
    return sorted(path for path, key in locks.items() if key not in held)


def _file_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def held_open_files() -> set[tuple[int, int]] | None:
    """(device, inode) of every file a process on this machine has open, from ``/proc``; None where there is no
    ``/proc`` (nothing can then be called stale)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    held: set[tuple[int, int]] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # exited, or another user's process (their builds use their own cache folder)
            continue
        for fd in fds:
            key = _file_key(f"{fd_dir}/{fd}")
            if key is not None:
                held.add(key)
    return held


def unprovable(path: str, mounts: list[Mount] | None = None) -> str | None:
    """Why ``path``, a lock no process of this machine holds open, may still be held elsewhere (a phrase), or None
    when it provably is a leftover (``mounts``: the mount table, default this process's)."""
    try:
        if os.path.getsize(path) > 0:
            return "it is not empty, so not a lock torch's FileBaton wrote"
    except OSError:
        return None
    return seen_by_others(mount_of(path, mounts))


def clear_stale_build_locks(root: str | None = None, mounts: list[Mount] | None = None) -> list[str]:
    """Delete the build locks under ``root`` (default :func:`extensions_root`) that provably no live process holds;
    returns them. A lock this machine cannot judge (:func:`unprovable`) is named in one line instead. Cheap when
    there is none (one ``glob``). Call it from one process per machine (local rank 0) before the group forms: the
    other ranks of the job cannot reach their build before then."""
    paths = glob.glob(os.path.join(root or extensions_root(), "*", LOCK_NAME))
    locks = {path: key for path in paths if (key := _file_key(path)) is not None}
    if not locks:
        return []
    held = held_open_files()
    if held is None:
        return []
    removed = []
    for path in stale_locks(locks, held):
        if _file_key(path) != locks[path]:  # replaced since: a new build holds it
            continue
        reason = unprovable(path, mounts)
        if reason is not None:
            print_all(
                f"left {path} in place: no process of this machine holds it, but {reason}, where a build elsewhere may "
                "(torch's lock records no host or pid); if no build of this extension runs anywhere, remove it, else "
                "this run waits for that build",
                file=sys.stderr,
            )
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
        print_all(
            f"removed {path}: a build of this torch extension was killed and left its lock, "
            "which would make every later run wait on it forever",
            file=sys.stderr,
        )
    return removed
