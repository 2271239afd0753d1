"""The run directory: only what a run wrote is ever removed (``run.json`` lists it; anything else refuses
``--overwrite_output_dir`` in one line); its lock works where ``flock`` does not; torch's build locks are removed
only where they provably are leftovers."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ds_bertopt import buildlocks
from ds_bertopt.errors import JobError
from ds_bertopt.mounts import mount_of, parse_mountinfo, seen_by_others
from ds_bertopt.train import rundir
from ds_bertopt.train.tasks.pretrain import main as pretrain_main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "ds_configs" / "bert.json")


def _tree(path: Path) -> list:
    return sorted(
        (str(p.relative_to(path)), p.is_dir(), p.read_bytes() if p.is_file() else b"") for p in path.rglob("*")
    )


def _earlier_run(out: Path, writes: list[str] | None = None) -> None:
    """What a finished run leaves (``writes=None``: a ``run.json`` of a version before the listing)."""
    (out / "checkpoints" / "step00000002").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step00000002")
    (out / "metrics.jsonl").write_text('{"step": 2}\n')
    (out / "config.json").write_text("{}")
    (out / ".lock").write_text("pid 1 on somewhere since 2025-01-01 00:00:00\n")
    run = {"run_id": "0123456789ab"} if writes is None else {"run_id": "0123456789ab", "writes": writes}
    (out / "run.json").write_text(json.dumps(run))


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "corpus.txt").write_text("mine")
    (project / "thesis.tex").write_text("\\documentclass{article}")
    return project


@pytest.mark.parametrize("output_dir", ["project", "."])
def test_overwrite_never_removes_what_no_run_wrote(tmp_path, capsys, monkeypatch, output_dir):
    """Was: "overwrite_output_dir: removed the earlier run in DIR", and thesis.tex and data/ were gone (``--output_dir
    . --overwrite_output_dir`` in a project folder emptied it). Now: one line naming them, nothing written."""
    project = _project(tmp_path)
    _earlier_run(project, writes=[".lock", "checkpoints", "config.json", "metrics.jsonl", "run.json"])
    before = _tree(project)
    monkeypatch.chdir(project if output_dir == "." else tmp_path)
    argv = ["--deepspeed_config", CONFIG, "--output_dir", output_dir, "--overwrite_output_dir", "--max_steps", "2"]
    assert pretrain_main([*argv, "-o", f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert (
        len(lines) == 1
        and f"train.output_dir: {project} holds data/, thesis.tex, which no ds_bertopt run wrote" in (lines[0])
    ), lines
    assert _tree(project) == before and not (tmp_path / "cache").exists()


def test_overwrite_removes_exactly_what_the_earlier_run_recorded(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _earlier_run(out, writes=[".lock", "checkpoints", "config.json", "final", "metrics.jsonl", "run.json"])
    (out / "config.json.tmp4242").write_text("{")  # an atomic write its run was killed in
    writes = rundir.planned_entries(_Train(), {}, str(out))
    with pytest.raises(JobError, match="already holds a run"):
        rundir.start_fresh(str(out), False, {"x": 1}, writes)
    run_id = rundir.start_fresh(str(out), True, {"x": 1}, writes)
    assert sorted(os.listdir(out)) == [".lock", "config.json", "run.json"]  # the lock is the new run's, held
    assert json.loads((out / "run.json").read_text()) == {"run_id": run_id, "writes": writes}
    # written by a version before the listing: what every version wrote is its; anything else refuses
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    _earlier_run(legacy)
    (legacy / "final").mkdir()
    (legacy / "notes.txt").write_text("mine")
    assert rundir.foreign_entries(str(legacy)) == ["notes.txt"]
    with pytest.raises(JobError, match=r"holds notes\.txt, which no ds_bertopt run wrote"):
        rundir.start_fresh(str(legacy), True, {}, writes)
    (legacy / "notes.txt").unlink()
    rundir.start_fresh(str(legacy), True, {}, writes)
    assert sorted(os.listdir(legacy)) == [".lock", "config.json", "run.json"]
    # a file named like ours but not ours, and a folder with no run.json: foreign
    other = tmp_path / "other"
    other.mkdir()
    (other / ".lock").write_text("held by my own tool\n")
    (other / "metrics.jsonl").write_text("mine\n")
    assert rundir.foreign_entries(str(other)) == [".lock", "metrics.jsonl"]


class _Train:
    save_model, log_samples = True, True


def test_planned_entries_name_every_writer(tmp_path):
    out = str(tmp_path / "run")
    ds = {
        "csv_monitor": {"enabled": True, "output_path": os.path.join(out, "monitor")},
        "tensorboard": {"enabled": True, "output_path": os.path.join(out, "tb", "x")},
        "flops_profiler": {"enabled": True, "output_file": str(tmp_path / "elsewhere.txt")},  # outside: not ours
    }
    assert rundir.planned_entries(_Train(), ds, out) == [
        *rundir.LOCK_FILES[:1],
        *sorted(rundir.LOCK_FILES[1:]),
        "checkpoints",
        "config.json",
        "final",
        "metrics.jsonl",
        "monitor",
        "run.json",
        "samples",
        "tb",
    ]


# --- the lock where flock is unsupported -------------------------------------------------------------------
def _no_flock(monkeypatch, code=errno.ENOLCK):
    """What NFS without a lock manager (ENOLCK) or Lustre without -o flock (ENOSYS) answer at the one flock call.
    No such filesystem can be mounted here (tmpfs, ext4, overlay and FUSE's default all support flock), so the
    errno is injected at ``rundir._flock``, the seam around ``fcntl.flock``."""

    def flock(fh):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(rundir, "_flock", flock)


NO_FLOCK = (
    "import errno, os, sys, time; import ds_bertopt.train.rundir as r\n"
    "def flock(fh): raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))\n"
    "r._flock = flock; held = r.RunLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)\n"
)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_without_flock_the_lock_is_an_exclusive_file(tmp_path, monkeypatch, capsys, code):
    _no_flock(monkeypatch, code)
    out = tmp_path / "run"
    first = rundir.RunLock(str(out))
    held = out / rundir.HELD_LOCK_FILE
    assert held.read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
    assert "does not support flock: the run's lock is the file" in capsys.readouterr().out
    with pytest.raises(JobError) as info:
        rundir.RunLock(str(out))  # this process's own live lock: never taken over
    assert f"is in use by another run (pid {os.getpid()} on " in str(info.value) and "\n" not in str(info.value)
    first.release()
    assert not held.exists()
    rundir.RunLock(str(out)).release()
    assert rundir.foreign_entries(str(out)) == []


def test_without_flock_a_dead_runs_lock_is_taken_over_and_another_hosts_never(tmp_path, monkeypatch, capsys):
    _no_flock(monkeypatch)
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", NO_FLOCK, str(out)], stdout=subprocess.PIPE, text=True, cwd=str(ROOT)
    )
    try:
        assert holder.stdout.readline().endswith(
            f"does not support flock: the run's lock is the file {out / '.lock.held'}\n"
        )
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(JobError, match=f"in use by another run \\(pid {holder.pid} on "):
            rundir.RunLock(str(out))
    finally:
        holder.kill()
        holder.wait()
    held = out / rundir.HELD_LOCK_FILE
    assert f"pid {holder.pid} " in held.read_text()  # killed: its lock file stays, and provably is dead
    lock = rundir.RunLock(str(out))
    assert f"took over {held}: its run (pid {holder.pid} on" in capsys.readouterr().out
    lock.release()
    # another host's lock (or one without the boot and namespace that prove a pid): named, never taken over
    for line in (
        "pid 1 on another-host since 2025-01-01 00:00:00 (boot b, pid namespace pid:[1], start 1)",
        f"pid 999999 on {socket.gethostname()} since 2025-01-01 00:00:00",
    ):
        held.write_text(line + "\n")
        with pytest.raises(JobError) as info:
            rundir.RunLock(str(out))
        message = str(info.value)
        assert f"({line}; " in message and f"if that run is dead, remove {held}" in message and "\n" not in message
        assert held.read_text() == line + "\n"


def test_another_flock_failure_is_one_line_naming_the_filesystem(tmp_path, monkeypatch):
    _no_flock(monkeypatch, errno.EIO)
    with pytest.raises(JobError, match=r"cannot lock .*/run on \S+ \(\w+, mounted at /\S*\): Input/output error$"):
        rundir.RunLock(str(tmp_path / "run"))


# --- torch's build locks: removed only where provably dead ----------------------------------------------------
def _mountinfo(tmp_path: Path, fstype: str, root: str = "/") -> str:
    return (
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        f"90 27 0:52 {root} {tmp_path} rw,relatime shared:7 - {fstype} server:/export/home rw,vers=4.2\n"
    )


def test_mount_table_and_who_else_can_see_a_folder(tmp_path):
    mounts = parse_mountinfo(_mountinfo(tmp_path, "nfs4") + "91 27 0:53 / /with\\040space rw - tmpfs tmpfs rw\n")
    assert mount_of(str(tmp_path / "a" / "b"), mounts).fstype == "nfs4"
    assert mount_of("/with space/x", mounts).point == "/with space"
    assert mount_of("/usr", mounts).fstype == "ext4" and seen_by_others(mount_of("/usr", mounts)) is None
    assert "which other hosts may share" in seen_by_others(mount_of(str(tmp_path), mounts))
    bind = parse_mountinfo(_mountinfo(tmp_path, "ext4", root="/srv/cache"))
    assert "bind mount of /srv/cache" in seen_by_others(mount_of(str(tmp_path), bind))


@pytest.mark.parametrize("fstype, root", [("nfs4", "/"), ("lustre", "/"), ("fuse.sshfs", "/"), ("xfs", "/home")])
def test_a_build_lock_other_hosts_may_hold_is_named_not_removed(tmp_path, capsys, fstype, root):
    (tmp_path / "ext").mkdir()
    lock = tmp_path / "ext" / "lock"
    lock.touch()  # what FileBaton leaves: an empty file, held by no process this machine shows
    mounts = parse_mountinfo(_mountinfo(tmp_path, fstype, root))
    assert buildlocks.clear_stale_build_locks(str(tmp_path), mounts=mounts) == []
    assert lock.exists()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if str(lock) in x]
    assert f"left {lock} in place: no process of this machine holds it, but it is on " in line
    # the same lock on a filesystem only this kernel serves is a leftover; a lock with content is not FileBaton's
    lock.write_text("pid 7 on elsewhere\n")
    assert buildlocks.clear_stale_build_locks(str(tmp_path), mounts=parse_mountinfo(_mountinfo(tmp_path, "ext4"))) == []
    assert lock.exists() and "it is not empty, so not a lock torch's FileBaton wrote" in capsys.readouterr().err
    lock.write_text("")
    assert buildlocks.clear_stale_build_locks(str(tmp_path), mounts=parse_mountinfo(_mountinfo(tmp_path, "ext4"))) == [
        str(lock)
    ]
