"""The run directory (``train.output_dir``): what a run writes there, and the lock that makes it one run's at a time.

**Only what a run wrote is ever removed.** Every top-level entry the loop and its tasks may create is named here
(:func:`planned_entries`: the lock, ``run.json``, ``config.json``, ``metrics.jsonl``, ``checkpoints/``, and with
their settings ``final/``, ``samples/`` and the DeepSpeed monitors' folders), and a run records that list in
``run.json`` (``"writes"``) before it writes anything else. ``--overwrite_output_dir`` removes the entries the earlier
run recorded and nothing else; a directory holding anything a run did not record (a ``thesis.tex``, a ``data/``
folder: ``--output_dir .`` typed in a project folder) is refused in one line naming the foreign entries, before
anything is written. A ``run.json`` from before the listing (``{"run_id": …}`` alone) counts as having written the
entries every version wrote (:data:`LEGACY_ENTRIES`); a directory with no ``run.json`` holds no run, so anything
but our own lock file in it is foreign.

**The lock** (:class:`RunLock`) is an OS lock (``flock``) on ``.lock``, dropped by the kernel when its process ends
however it ends. Where the filesystem does not support ``flock`` (Lustre mounted without ``flock``: ENOSYS; NFS
without a lock manager: ENOLCK; some FUSE filesystems: EOPNOTSUPP) the lock is an ``O_EXCL``-created
:data:`HELD_LOCK_FILE` (atomic on NFSv3+ and Lustre) carrying the holder's host, pid, boot and pid namespace; one
left by a killed run is taken over only when it provably is dead (this host, this boot, this pid namespace, the
process gone), never a lock of another host, which is named with the way out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from typing import Optional

from ..errors import JobError
from ..log import print0
from ..mounts import describe_filesystem

RUN_FILE = "run.json"
CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"
HELD_LOCK_FILE = ".lock.held"
"""The lock where ``flock`` is unsupported: it exists while a run holds the directory."""
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
SAMPLES_DIR = "samples"
MONITOR_DIR = "monitor"
"""Where DeepSpeed's ``csv_monitor``/``tensorboard`` write when their ``output_path`` is not given (the pre-flight
sets it)."""
TAKEOVER_FILE = f"{HELD_LOCK_FILE}.takeover"
"""Held for a moment while the lock of a dead run is taken over (see :meth:`RunLock._remove_dead_lock`)."""
LOCK_FILES = (LOCK_FILE, HELD_LOCK_FILE, TAKEOVER_FILE)
LEGACY_ENTRIES = (LOCK_FILE, RUN_FILE, CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR, SAMPLES_DIR, MONITOR_DIR)
"""What a run of a version before ``run.json``'s ``"writes"`` may have written (those versions wrote exactly these)."""
_ATOMIC_TMP = re.compile(r"^(?P<name>.+)\.tmp\d+$")  # what an atomic write killed half-way leaves (checkpoint)
_DS_PATH_KEYS = (("csv_monitor", "output_path"), ("tensorboard", "output_path"), ("flops_profiler", "output_file"))


def planned_entries(train, deepspeed: dict, output_dir: str) -> list[str]:
    """The top-level entries of ``output_dir`` that a run with ``train`` (its ``TrainConfig``) and ``deepspeed``
    (its resolved DeepSpeed part) may create, sorted. Every writer under ``ds_bertopt/train`` names its entry by
    the constants above."""
    names = {*LOCK_FILES, RUN_FILE, CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR}
    if train.save_model:
        names.add(FINAL_DIR)
    if train.log_samples:
        names.add(SAMPLES_DIR)
    root = os.path.abspath(output_dir)
    for block, key in _DS_PATH_KEYS:
        section = deepspeed.get(block)
        if isinstance(section, dict) and section.get("enabled") and isinstance(section.get(key), str):
            path = os.path.abspath(os.path.expanduser(section[key]))
            inside = os.path.relpath(path, root)
            if inside != "." and not inside.startswith(os.pardir):
                names.add(inside.split(os.sep)[0])
    return sorted(names)


def read_run(output_dir: str) -> Optional[dict]:
    """``output_dir/run.json`` when a ds_bertopt run wrote it (an object with a ``run_id``), else None."""
    try:
        with open(os.path.join(output_dir, RUN_FILE), encoding="utf-8") as fh:
            run = json.load(fh)
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) and isinstance(run.get("run_id"), str) else None


def read_run_id(output_dir: str) -> Optional[str]:
    run = read_run(output_dir)
    return run["run_id"] if run else None


def recorded_entries(output_dir: str) -> set[str]:
    """What the run in ``output_dir`` recorded writing (an older version's run: :data:`LEGACY_ENTRIES`); empty
    when no run is recorded there."""
    run = read_run(output_dir)
    if run is None:
        return set()
    writes = run.get("writes")
    if not isinstance(writes, list):
        return set(LEGACY_ENTRIES)
    return {str(name) for name in writes} | {RUN_FILE}


def _our_lock_file(path: str) -> bool:
    """A lock file we wrote: empty (a run that died before writing its holder line) or our holder line."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return False
    return not text or _HOLDER.match(text) is not None


def entries(output_dir: str) -> list[str]:
    """The entries of ``output_dir``, sorted (none when it does not exist)."""
    return sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []


def foreign_entries(output_dir: str) -> list[str]:
    """The entries of ``output_dir`` that no ds_bertopt run recorded writing, sorted: what must never be removed."""
    ours = recorded_entries(output_dir)

    def is_ours(name: str) -> bool:
        if name in LOCK_FILES:
            return _our_lock_file(os.path.join(output_dir, name))
        tmp = _ATOMIC_TMP.match(name)
        return name in ours or (tmp is not None and tmp.group("name") in ours)

    return [name for name in entries(output_dir) if not is_ours(name)]


def holds_run(output_dir: str) -> bool:
    """Whether ``output_dir`` holds anything besides lock files (an earlier run, one running now, or foreign files)."""
    return any(name not in LOCK_FILES for name in entries(output_dir))


def describe_entries(output_dir: str, names: list[str]) -> str:
    """``a, data/, thesis.tex`` (directories with a slash), up to three, then how many in all."""
    shown = [f"{n}/" if os.path.isdir(os.path.join(output_dir, n)) else n for n in names[:3]]
    return ", ".join(shown) + (f", … ({len(names)} in all)" if len(names) > 3 else "")


def foreign_line(output_dir: str, foreign: list[str]) -> str:
    """The one line refusing a run directory that holds entries no run wrote."""
    return (
        f"train.output_dir: {output_dir} holds {describe_entries(output_dir, foreign)}, which no ds_bertopt run "
        "wrote; a run never removes or mixes into files it did not write (--overwrite_output_dir removes only what "
        "an earlier run recorded in its run.json): choose a new or empty --output_dir"
    )


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_run(output_dir: str, run_id: str, writes: list[str]) -> None:
    """``run.json``: the run's id and every entry it may write (merged with what it recorded before, on resume)."""
    os.makedirs(output_dir, exist_ok=True)
    earlier = read_run(output_dir)
    recorded = set(writes) | (recorded_entries(output_dir) if earlier and earlier["run_id"] == run_id else set())
    write_atomic(os.path.join(output_dir, RUN_FILE), json.dumps({"run_id": run_id, "writes": sorted(recorded)}))


def start_fresh(output_dir: str, overwrite: bool, described: dict, writes: list[str]) -> str:
    """Rank 0, holding the :class:`RunLock`: the run directory of a new run (``run.json`` listing ``writes``, then
    ``config.json``); with ``overwrite`` the entries an earlier run recorded are removed first, nothing else.
    Returns the run id."""
    foreign = foreign_entries(output_dir)
    if foreign:  # appeared after this run's pre-flight
        raise JobError(foreign_line(output_dir, foreign))
    if holds_run(output_dir):
        if not overwrite:
            raise JobError(
                f"train.output_dir: {output_dir} already holds a run, written after this run's pre-flight (another "
                "run started with it at the same time?); continue it with --resume, or choose another --output_dir"
            )
        removed = [name for name in entries(output_dir) if name not in LOCK_FILES]  # all recorded (no foreign)
        for name in removed:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        print0(
            f"overwrite_output_dir: removed the earlier run's {describe_entries(output_dir, removed) or 'files'} "
            f"from {output_dir} (what it recorded writing; nothing else was there)"
        )
    run_id = uuid.uuid4().hex[:12]
    write_run(output_dir, run_id, writes)
    write_atomic(os.path.join(output_dir, CONFIG_FILE), json.dumps(described, indent=2))
    return run_id


# --- the run directory belongs to one run at a time -----------------------------------------------------
FLOCK_UNSUPPORTED = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
"""``flock`` errors that mean the filesystem cannot lock (Lustre without ``flock``: ENOSYS; NFS without lockd:
ENOLCK; FUSE and others: EOPNOTSUPP), as opposed to a lock someone else holds (EWOULDBLOCK)."""
_HOLDER = re.compile(
    r"^pid (?P<pid>\d+) on (?P<host>\S+) since [^()]*"
    r"(\(boot (?P<boot>\S+), pid namespace (?P<ns>\S+), start (?P<start>\d+)\))?$"
)


def _flock(fh) -> None:
    """The one ``flock`` call: exclusive, non-blocking (tests make it fail as an unsupporting filesystem does)."""
    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _start_ticks(pid: int) -> Optional[str]:
    """When process ``pid`` of this machine started (clock ticks since boot, ``/proc/PID/stat`` field 22); None when
    no such process runs (or ``/proc`` cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]  # fields after the command name start at field 3
    except (OSError, IndexError):
        return None


def _this_machine() -> Optional[tuple[str, str]]:
    """(boot id, pid namespace) of this process: a pid means the same process only within both."""
    try:
        return _read_text("/proc/sys/kernel/random/boot_id"), os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_line() -> str:
    """Who holds a lock: ``pid P on HOST since DATE (boot B, pid namespace N, start S)``."""
    since = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    machine, start = _this_machine(), _start_ticks(os.getpid())
    return f"{since} (boot {machine[0]}, pid namespace {machine[1]}, start {start})" if machine and start else since


def provably_dead(holder: str) -> bool:
    """Whether the process named by a :func:`holder_line` is gone, judged only where that can be proven: written on
    this host, in this boot and pid namespace, and no process of that pid and start time runs. Another host's (or an
    unreadable) holder is never judged dead."""
    found = _HOLDER.match(holder)
    if found is None or found["boot"] is None or found["host"] != socket.gethostname():
        return False
    if (found["boot"], found["ns"]) != _this_machine():
        return False
    return _start_ticks(int(found["pid"])) != found["start"]


class RunLock:
    """Rank 0 holds it from before the run's first write until its process ends (see the module docstring)."""

    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir, self.held = output_dir, None
        self.fh = open(os.path.join(output_dir, LOCK_FILE), "a+", encoding="utf-8")  # noqa: SIM115 - held
        try:
            _flock(self.fh)
        except BlockingIOError:
            self.fh.seek(0)
            holder = self.fh.read().strip() or "holder unknown"
            self.fh.close()
            raise JobError(
                f"train.output_dir: {output_dir} is in use by another run ({holder}); wait for it to end, or "
                "choose another --output_dir"
            ) from None
        except OSError as exc:
            self.fh.close()
            if exc.errno not in FLOCK_UNSUPPORTED:
                raise JobError(
                    f"train.output_dir: cannot lock {output_dir} on {describe_filesystem(output_dir)}: {exc.strerror}"
                ) from None
            self.held = self._hold_exclusive_file(exc)
            return
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(holder_line() + "\n")
        self.fh.flush()

    def _hold_exclusive_file(self, flock_error: OSError) -> str:
        """The lock where ``flock`` is unsupported: :data:`HELD_LOCK_FILE` created with ``O_EXCL``."""
        path = os.path.join(self.output_dir, HELD_LOCK_FILE)
        for attempt in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, where = _read_text(path) or "holder unknown", describe_filesystem(self.output_dir)
                if attempt == 0 and provably_dead(holder):
                    self._remove_dead_lock(path, holder)
                    continue
                raise JobError(
                    f"train.output_dir: {self.output_dir} is in use by another run ({holder}; {where} has no flock, "
                    f"so the lock is the file {path}); wait for it to end, or, if that run is dead, remove {path}"
                ) from None
            except OSError as exc:
                where = describe_filesystem(self.output_dir)
                raise JobError(
                    f"train.output_dir: {self.output_dir} cannot be locked: its filesystem {where} "
                    f"supports neither flock ({flock_error.strerror}) nor exclusive creation ({exc.strerror}); choose "
                    "an --output_dir on another filesystem"
                ) from None
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(holder_line() + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            where = describe_filesystem(self.output_dir)
            print0(f"note: {where} does not support flock: the run's lock is the file {path}")
            return path
        raise AssertionError("unreachable")

    def _remove_dead_lock(self, path: str, holder: str) -> None:
        """Remove the lock of a dead run, under a second ``O_EXCL`` file so that two runs taking over at once never
        remove the lock one of them has just created."""
        breaker = os.path.join(self.output_dir, TAKEOVER_FILE)
        try:
            fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            raise JobError(
                f"train.output_dir: another run is taking over {path} (the lock of a dead run) right now; if none "
                f"is starting, remove {breaker}"
            ) from None
        try:
            if _read_text(path) == holder:
                os.unlink(path)
                print0(f"took over {path}: its run ({holder}) is no longer running")
        finally:
            os.close(fd)
            os.unlink(breaker)

    def release(self) -> None:
        if self.held is not None:
            if _read_text(self.held).startswith(f"pid {os.getpid()} on {socket.gethostname()} "):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.held)
            self.held = None
        elif not self.fh.closed:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
