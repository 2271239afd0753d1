"""Which filesystem holds a path (from ``/proc/self/mountinfo``), said as users know it, and whether processes this
machine cannot see may use it (another host over NFS/Lustre/…, another container through a bind mount)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

MOUNTINFO = "/proc/self/mountinfo"

LOCAL_TYPES = frozenset(
    "ext2 ext3 ext4 xfs btrfs f2fs jfs reiserfs bcachefs zfs tmpfs ramfs overlay devtmpfs squashfs erofs".split()
)
"""Filesystems only this machine's kernel serves. Anything else (nfs, nfs4, lustre, gpfs, beegfs, cephfs, cifs,
smb3, glusterfs, 9p, virtiofs, fuse.*, …) may be shared with processes this machine's ``/proc`` does not show."""


@dataclass(frozen=True)
class Mount:
    device: str
    fstype: str
    point: str
    root: str
    """The part of the filesystem mounted there: ``/`` for a whole filesystem, a folder for a bind mount."""

    def describe(self) -> str:
        return f"{self.device} ({self.fstype}, mounted at {self.point})"


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field  # \040 for a space, as the kernel writes


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/PID/mountinfo`` text (``ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL…] - TYPE
    SOURCE SUPER``; proc(5))."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        mounts.append(Mount(device=_unescape(fields[dash + 2]), fstype=fields[dash + 1], point=point, root=root))
    return mounts


def existing_parent(path: str) -> str:
    """``path`` or its nearest existing ancestor, absolute."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def mount_of(path: str, mounts: Optional[list[Mount]] = None) -> Optional[Mount]:
    """The mount holding ``path`` (the longest mount point above it; the last one mounted there is the visible one);
    None where the mount table cannot be read."""
    if mounts is None:
        try:
            with open(MOUNTINFO, encoding="utf-8") as fh:
                mounts = parse_mountinfo(fh.read())
        except OSError:
            return None
    existing = existing_parent(path)
    real = os.path.normpath(os.path.join(os.path.realpath(existing), os.path.relpath(os.path.abspath(path), existing)))
    best = None
    for mount in mounts:
        point = mount.point.rstrip("/") or "/"
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best.point.rstrip("/") or "/"):
                best = mount
    return best


def device_of(path: str) -> str:
    """The filesystem holding ``path``, as the user knows it: ``/dev/sda1 (mounted at /data)``."""
    mount = mount_of(path)
    if mount is None:
        return existing_parent(path)
    return mount.point if mount.device == mount.point else f"{mount.device} (mounted at {mount.point})"


def describe_filesystem(path: str) -> str:
    """``/dev/sda1 (ext4, mounted at /data)``."""
    mount = mount_of(path)
    return mount.describe() if mount is not None else existing_parent(path)


def seen_by_others(mount: Optional[Mount]) -> Optional[str]:
    """Why processes this machine's ``/proc`` does not show may use ``mount`` (a phrase), or None when only this
    machine's processes can: a filesystem type not in :data:`LOCAL_TYPES`, or a bind mount of a folder (how
    container volumes and shared homes are mounted). An unreadable mount table proves nothing either."""
    if mount is None:
        return "the mount table cannot be read"
    if mount.fstype not in LOCAL_TYPES:
        return f"it is on {mount.describe()}, which other hosts may share"
    if mount.root != "/":
        return f"it is on a bind mount of {mount.root} ({mount.describe()}), which other containers may share"
    return None
