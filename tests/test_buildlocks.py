"""A killed torch-extension build leaves ``<build dir>/lock`` behind, and torch's ``FileBaton`` then makes every
later process that loads the extension wait forever (DeepSpeed builds ``deepspeed_shm_comm`` when its process
group forms). A lock no live process holds open is removed before the group forms; one held by a live build is
left alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from _launch import deepspeed_cmd, pretrain_args, run

from ds_bertopt.buildlocks import clear_stale_build_locks, extensions_root, stale_locks
from ds_bertopt.testing.distributed import free_port

SHM_COMM = "deepspeed_shm_comm"


def test_stale_locks_are_those_no_process_holds():
    locks = {"/r/b/lock": (1, 20), "/r/a/lock": (1, 10), "/r/c/lock": (2, 10)}
    assert stale_locks(locks, held={(1, 20), (9, 9)}) == ["/r/a/lock", "/r/c/lock"]
    assert stale_locks(locks, held={(1, 10), (1, 20), (2, 10)}) == []


HOLDER = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_live_builders_lock_stays_and_a_killed_builders_lock_goes(tmp_path):
    """The real ``FileBaton`` held by a live process, then by a process killed mid-"build"."""
    (tmp_path / "ext_a").mkdir()
    (tmp_path / "ext_b").mkdir()
    lock_a, lock_b = tmp_path / "ext_a" / "lock", tmp_path / "ext_b" / "lock"
    lock_b.touch()  # left by a build killed earlier
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_a)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clear_stale_build_locks(str(tmp_path)) == [str(lock_b)]
        assert lock_a.exists() and not lock_b.exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert lock_a.exists()  # what a killed build leaves
        assert clear_stale_build_locks(str(tmp_path)) == [str(lock_a)]
        assert not lock_a.exists()
        assert clear_stale_build_locks(str(tmp_path)) == []
    finally:
        holder.kill()
        holder.wait()


def _extensions_with_a_stale_shm_lock(tmp_path):
    """A private extensions folder whose shm_comm build (copied when one exists, so nothing is rebuilt) carries
    the lock a killed build leaves."""
    root = tmp_path / "torch_extensions"
    built = os.path.join(extensions_root(), SHM_COMM)
    if os.path.exists(os.path.join(built, f"{SHM_COMM}.so")):
        shutil.copytree(built, root / SHM_COMM, ignore=shutil.ignore_patterns("lock"))
    else:
        (root / SHM_COMM).mkdir(parents=True)
    (root / SHM_COMM / "lock").touch()
    return root


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_launcher_run_after_a_killed_build_starts_instead_of_waiting_forever(tmp_path, cache_dir):
    root = _extensions_with_a_stale_shm_lock(tmp_path)
    proc = run(
        deepspeed_cmd(
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            *pretrain_args(tmp_path / "out", cache_dir, "--max_steps", "2", "--eval_every", "0"),
        ),
        300,
        TORCH_EXTENSIONS_DIR=str(root),
    )
    output = proc.stdout + proc.stderr
    assert f"removed {root / SHM_COMM / 'lock'}: a build of this torch extension was killed" in output, output[-3000:]
    assert output.count("a build of this torch extension was killed") == 1  # local rank 0 alone cleans up
    assert "done: 2 steps" in output, output[-3000:]
    assert not (root / SHM_COMM / "lock").exists() and (root / SHM_COMM / f"{SHM_COMM}.so").exists()
