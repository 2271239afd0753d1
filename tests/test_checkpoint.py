"""Checkpoint files we write and read ourselves: RNG states round-trip, and loading them runs no code; the run
identity (task, data, not the cache path); one run per output directory; a full disk mid-save."""

from __future__ import annotations

import errno
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_bertopt.dist import Topology
from ds_bertopt.errors import JobError
from ds_bertopt.mounts import device_of
from ds_bertopt.train.checkpoint import (
    identity,
    identity_mismatch,
    load_rng_state,
    rng_state,
    save,
    set_rng_state,
    write_failure,
)
from ds_bertopt.train.rundir import LOCK_FILE, RunLock, holds_run

ROOT = Path(__file__).resolve().parents[1]


def _draws():
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), float(torch.rand(1))


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.randn()  # leave a cached Gaussian in both generators
    path = tmp_path / "rng_rank0.pt"
    torch.save(rng_state(), path)
    expected = _draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_rng_state(str(path)))
    assert _draws() == expected


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_a_crafted_rng_file_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "rng_rank0.pt"
    with open(path, "wb") as fh:
        pickle.dump({"python": _Payload()}, fh)
    with pytest.raises(pickle.UnpicklingError):
        load_rng_state(str(path))
    assert not (tmp_path / "PWNED").exists()


# --- run identity: the task and the data themselves, not where the cache is -----------------------------------
def _identity(task="pretrain", cache="/a", data=None):
    described = {"bertopt": {"data": {"cache_dir": cache, "seed": 1}, "model": {"hidden_size": 128}}}
    return identity("r1", 2, described, task, data)


def test_identity_compares_the_task_and_the_data_not_the_cache_path():
    data = {"vocabulary": "v1", "samples": "s1"}
    saved = _identity(data=data)
    assert identity_mismatch(saved, _identity(cache="/elsewhere", data=data)) is None  # a moved cache resumes
    assert identity_mismatch(saved, _identity(cache="/elsewhere")) is None  # the pre-flight: data not built yet
    assert identity_mismatch(saved, _identity(data={**data, "vocabulary": "v2"})).startswith(
        "the vocabulary differs from the checkpoint's (v1, now v2): the tokenizer the run started with has changed"
    )
    assert identity_mismatch(saved, _identity(data={**data, "samples": "s2"})).startswith(
        "the training samples differ from the checkpoint's (s1, now s2): the corpus or labelled files have changed"
    )
    # a fine-tuning run directory given to the pretraining entry point: said first, not its first config key
    assert identity_mismatch(_identity(task="finetune"), _identity()) == (
        "it is a checkpoint of a finetune run, and this is pretrain: resume it with launch/finetune.py, or give "
        "this run another --output_dir"
    )
    legacy = {k: v for k, v in _identity(task="finetune").items() if k != "task"}  # written before it was kept
    legacy["config"]["bertopt.finetune.train_file"] = "train.csv"
    assert identity_mismatch(legacy, _identity()).startswith("it is a checkpoint of a finetune run")
    old = {k: v for k, v in saved.items() if k not in ("task", "data")}  # written before either was kept
    old["config"]["bertopt.data.cache_dir"] = "/a"  # older versions kept the cache path too
    assert identity_mismatch(old, _identity(cache="/b", data=data)) is None


# --- one run per output directory -----------------------------------------------------------------------------
def test_the_output_directory_lock_refuses_a_second_run_and_dies_with_its_process(tmp_path):
    out = tmp_path / "run"
    first = RunLock(str(out))
    with pytest.raises(JobError) as info:
        RunLock(str(out))  # a second open file description: what another run's process would hold
    assert str(info.value).startswith(f"train.output_dir: {out} is in use by another run (pid {os.getpid()} on ")
    assert str(info.value).endswith("; wait for it to end, or choose another --output_dir")
    first.release()
    RunLock(str(out)).release()
    assert not holds_run(str(out))  # the lock file alone is no run
    # a killed run leaves its lock file, not its lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from ds_bertopt.train.rundir import RunLock; held = RunLock({str(out)!r}); "
            "print('locked', flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(JobError, match=f"pid {holder.pid} on "):
        RunLock(str(out))
    holder.kill()
    holder.wait()
    assert f"pid {holder.pid}" in (out / LOCK_FILE).read_text()  # stale
    RunLock(str(out)).release()


# --- a full disk during a save: one line, the .partial removed, the last good checkpoint named ----------------
class _Engine:
    """DeepSpeed's checkpoint write path (its TorchCheckpointEngine) behind a minimal ``save_checkpoint``."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine()

    def save_checkpoint(self, root, tag, client_state, save_latest):  # noqa: ARG002
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            self.checkpoint_engine.save({"w": torch.zeros(8), **client_state}, os.path.join(root, tag, name))


def test_a_full_disk_during_a_save_ends_in_one_line(tmp_path, monkeypatch):
    topo = Topology(rank=0, world_size=1, local_rank=0, ranks_per_node=1, node_rank=0)
    engine, root = _Engine(), tmp_path / "checkpoints"
    save(engine, str(tmp_path), 2, {"step": 2}, topo, keep_last=3)
    monkeypatch.setenv("DS_BERTOPT_FAULT", "enospc@write:rank=0:step=4")
    with pytest.raises(JobError) as info:
        save(engine, str(tmp_path), 4, {"step": 4}, topo, keep_last=3)
    assert str(info.value) == (
        f"no space left on {device_of(str(root))} while writing checkpoint step00000004; removed "
        f"step00000004.partial; the last good checkpoint is {root / 'step00000002'}"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step00000002"]
    assert (root / "latest").read_text() == "step00000002"
    assert "save" not in vars(engine.checkpoint_engine)  # DeepSpeed's writer is left as it was


def test_write_failures_are_told_apart(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    assert write_failure(full, str(tmp_path), "step00000001").startswith("no space left on ")
    try:  # torch's zip writer on a full disk: no errno, only the chained text (or an empty filesystem)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64") from full
    except RuntimeError as chained:
        assert write_failure(chained, str(tmp_path), "step00000001").startswith("no space left on ")
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x.pt"))
    assert write_failure(denied, str(tmp_path), "step00000001") == (
        f"cannot write checkpoint step00000001: Permission denied ({tmp_path / 'x.pt'})"
    )
    assert write_failure(KeyError("a bug"), str(tmp_path), "step00000001") is None  # keeps its traceback
    assert device_of("/proc/self") == "proc (mounted at /proc)"
