"""Atomic, resumable checkpoints around ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Layout under ``<output_dir>/checkpoints``: ``stepNNNNNNNN/`` (DeepSpeed's files, ``rng_rank<r>.pt`` and, written
last, ``COMPLETE.json`` with the step, the sampler position and the run's :func:`identity`), ``<tag>.partial/``
(a save in progress or one that died: never loaded) and ``latest`` (replaced atomically). Only when every rank
has saved does local rank 0 of each node mark, rename and switch ``latest``, so a crash at any point leaves the
previous checkpoint complete. Resume loads only checkpoints of the same run whose identity matches the config
given now (:func:`identity_mismatch` names the first difference), falls back to the newest older complete one
when ``latest`` is stale or loading fails on any rank, and says so. The last ``keep_last`` are kept.

A save that fails (a full disk, anywhere: DeepSpeed's files, ours, the marker) is agreed on by all ranks, its
``.partial`` removed, and every rank raises one line (``no space left on DEVICE while writing checkpoint N``,
naming the last good checkpoint); DeepSpeed's writes record their failure instead of raising mid-save, so no
rank is left waiting in one of DeepSpeed's barriers. The run directory itself (what a run writes there, its lock):
:mod:`.rundir`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import socket
from typing import Optional

import numpy as np
import torch

from .. import faults
from ..compat.deepspeed import checkpoint_writer
from ..dist import Topology, all_views, barrier
from ..errors import BertOptError, JobError
from ..log import print0
from ..mounts import device_of, existing_parent
from .rundir import CHECKPOINTS_DIR, write_atomic

MARKER = "COMPLETE.json"
LATEST = "latest"
_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS_DIR)


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states as tensors, numbers and strings only, so that
    :func:`load_rng_state` reads them with ``torch.load(weights_only=True)``: a crafted checkpoint
    cannot run code through them (unlike a pickled ``random.getstate()`` tuple)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rng_state(path: str) -> dict:
    return torch.load(path, weights_only=True)


def complete_tags(root: str) -> list[str]:
    """Complete checkpoint tags under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    tags = [name for name in os.listdir(root) if _TAG.match(name) and os.path.isfile(os.path.join(root, name, MARKER))]
    return sorted(tags, reverse=True)


def save(engine, output_dir: str, step: int, client_state: dict, topo: Topology, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the final checkpoint directory; a failed write raises one line
    (:class:`~ds_bertopt.errors.JobError`) on every rank after the ``.partial`` is removed."""
    rank, local_rank = topo.rank, topo.local_rank
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    partial = f"{tag}.partial"
    failures: list = []
    if local_rank == 0:
        with _recorded(failures, root):
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(os.path.join(root, partial), ignore_errors=True)  # a dead earlier attempt
    _agree(failures, root, tag, topo)
    with _writes_recorded(engine, failures, rank, step):
        engine.save_checkpoint(root, tag=partial, client_state=client_state, save_latest=False)
    if not failures:
        with _recorded(failures, os.path.join(root, partial)):
            os.makedirs(os.path.join(root, partial), exist_ok=True)
            torch.save(rng_state(), os.path.join(root, partial, f"rng_rank{rank}.pt"))
    faults.inject("save", rank, step)
    _agree(failures, root, tag, topo)
    final = os.path.join(root, tag)
    kept = ("world_size", "sampler", "identity")
    marker = {"step": step, "tag": tag, **{k: client_state[k] for k in kept if k in client_state}}
    # Global rank 0 finalises first; then the local rank 0 of any node whose filesystem is not
    # shared with rank 0 (it still sees its own ``.partial``) finalises its copy.
    if rank == 0:
        with _recorded(failures, root):
            _finalise(root, partial, final, tag, marker, keep_last)
    _agree(failures, root, tag, topo)
    if rank != 0 and local_rank == 0 and os.path.isdir(os.path.join(root, partial)):
        with _recorded(failures, root):
            _finalise(root, partial, final, tag, marker, keep_last)
    _agree(failures, root, tag, topo)
    return final


@contextlib.contextmanager
def _recorded(failures: list, path: str):
    """Record an exception of the block in ``failures`` as ``(path, exception)`` instead of raising it."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - judged by _agree, with every rank
        failures.append((path, exc))


@contextlib.contextmanager
def _writes_recorded(engine, failures: list, rank: int, step: int):
    """DeepSpeed's checkpoint writes record a failure in ``failures`` instead of raising it, so every rank still
    reaches the barriers inside ``engine.save_checkpoint``; once one failed, nothing more is written.
    (``checkpoint_engine.save`` is DeepSpeed's one write path for model and ZeRO shard files, 0.16-0.19.)"""
    writer = checkpoint_writer(engine)
    own = "save" in vars(writer)
    original = writer.save

    def save(state_dict, path):
        if failures:
            return
        with _recorded(failures, path):
            faults.inject("write", rank, step)
            original(state_dict, path)

    writer.save = save
    try:
        yield
    finally:
        if own:
            writer.save = original
        else:
            del writer.save


def _agree(failures: list, root: str, tag: str, topo: Topology) -> None:
    """Collective (it replaces a barrier): if any rank's write failed, every node's local rank 0 removes the
    ``.partial`` and every rank raises the same line; the rank whose write failed for another reason than the
    filesystem re-raises its own exception (a bug keeps its traceback)."""
    mine = None
    if failures:
        path, exc = failures[0]
        mine = (topo.rank, socket.gethostname(), write_failure(exc, path, tag))
    views = [v for v in all_views(mine) if v is not None]
    if not views:
        return
    if topo.local_rank == 0:
        shutil.rmtree(os.path.join(root, f"{tag}.partial"), ignore_errors=True)
    barrier()
    if mine is not None and mine[2] is None:
        raise failures[0][1]  # not the filesystem: this rank's own exception, with its traceback
    rank, host, line = views[0]
    where = f" (rank {rank} on {host})" if topo.world_size > 1 else ""
    good = complete_tags(root)
    kept = f"the last good checkpoint is {os.path.join(root, good[0])}" if good else "no checkpoint is complete yet"
    line = line or f"checkpoint {tag} could not be written (see the traceback of the rank that failed)"
    raise JobError(f"{line}{where}; removed {tag}.partial; {kept}")


FULL_BYTES = 1 << 20
"""A filesystem with less than this free after a failed write is taken to be full (torch's zip writer reports a
full disk without an errno: ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos``)."""


def disk_full(exc: BaseException, path: str) -> bool:
    """Whether ``exc`` (or an exception it chains) is a full disk or quota, or the filesystem of ``path`` is full."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        stat = os.statvfs(existing_parent(path))
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < FULL_BYTES


def write_failure(exc: BaseException, path: str, tag: str) -> Optional[str]:
    """One line for a checkpoint write that failed on the filesystem; None for any other failure (a bug)."""
    if disk_full(exc, path):
        return f"no space left on {device_of(path)} while writing checkpoint {tag}"
    if isinstance(exc, OSError):
        return f"cannot write checkpoint {tag}: {exc.strerror or exc} ({exc.filename or path})"
    return None


def _finalise(root: str, partial: str, final: str, tag: str, marker: dict, keep_last: int) -> None:
    """Mark complete, rename into place, switch ``latest``, prune: in this order."""
    write_atomic(os.path.join(root, partial, MARKER), json.dumps(marker, indent=1))
    if os.path.isdir(final):  # re-saving the same step (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(os.path.join(root, partial), final)
    write_atomic(os.path.join(root, LATEST), tag)
    for old in complete_tags(root)[keep_last:]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def resolve_resume_dir(resume: str, output_dir: str) -> str:
    """``--resume`` (``auto`` = this run's output dir) → the checkpoint root; must exist."""
    base = output_dir if resume == "auto" else os.path.abspath(os.path.expanduser(resume))
    root = base if os.path.basename(os.path.normpath(base)) == "checkpoints" else checkpoint_root(base)
    if not os.path.exists(base):
        raise BertOptError(f"resume directory {base} does not exist")
    if not os.path.isdir(base):
        raise BertOptError(f"resume directory {base} is not a directory (give the run's output directory)")
    if not os.path.isdir(root) or not complete_tags(root):
        raise BertOptError(
            f"resume directory {base} holds no complete checkpoint (checkpoints/stepNNNNNNNN/ with "
            f"{MARKER}); start without --resume"
        )
    return root


# --- run identity -----------------------------------------------------------------------------------
# Keys that may differ between a run and its resumption: where and how often it reports, not what it computes;
# how long it runs (a run may be extended: the LR schedule then spans the new length, and the loop says so); and
# where the data cache is (the vocabulary and samples themselves are compared, see identity()).
_TRAIN_KEYS = (
    "max_steps epochs output_dir overwrite_output_dir eval_every eval_each_epoch log_every save_every keep_last"
)
_TRAIN_KEYS += " save_model dataloader_workers dist_timeout_s dist_init_timeout_s log_samples max_consecutive_nonfinite"
_TRAIN_KEYS += " allow_unread_keys"
_DS_KEYS = "steps_per_print wall_clock_breakdown csv_monitor tensorboard wandb comet flops_profiler comms_logger"
OPERATIONAL_KEYS = (
    *(f"bertopt.train.{k}" for k in _TRAIN_KEYS.split()),
    "bertopt.data.cache_dir",
    *(f"deepspeed.{k}" for k in _DS_KEYS.split()),
)
TASK_SCRIPTS = {"pretrain": "launch/pretrain.py", "finetune": "launch/finetune.py"}


def _flatten(tree, prefix: str, out: dict) -> dict:
    if isinstance(tree, dict) and tree and prefix not in OPERATIONAL_KEYS:
        for key, value in tree.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif prefix not in OPERATIONAL_KEYS:
        out[prefix] = tree
    return out


def identity(
    run_id: str, world_size: int, described: dict, task: Optional[str] = None, data: Optional[dict] = None
) -> dict:
    """What a checkpoint must share with the run that resumes it (``described``: ``config.describe``; ``task``:
    the task's name; ``data``: :meth:`~ds_bertopt.data.identity.DataFingerprint.identity`, once built)."""
    out = {"run_id": run_id, "world_size": world_size, "config": _flatten(described, "", {})}
    if task is not None:
        out["task"] = task
    if data is not None:
        out["data"] = data
    return out


def _task_of(saved: dict) -> Optional[str]:
    """The task a checkpoint's identity names; for one written before the task was kept, what its config says
    (only fine-tuning sets ``finetune.train_file``)."""
    if "task" in saved or "config" not in saved:
        return saved.get("task")
    return "finetune" if saved["config"].get("bertopt.finetune.train_file") else "pretrain"


def identity_mismatch(saved: dict, current: dict) -> Optional[str]:
    """One line naming the first difference between a checkpoint's identity and this run's, or None. Parts one
    side lacks (the task and data of older checkpoints, the data before it is built) are not compared."""
    task, theirs_task = current.get("task"), _task_of(saved)
    if task and theirs_task and task != theirs_task:
        script = TASK_SCRIPTS.get(theirs_task, theirs_task)
        return (
            f"it is a checkpoint of a {theirs_task} run, and this is {task}: resume it with {script}, or give "
            f"this run another --output_dir"
        )
    if saved.get("world_size") != current["world_size"]:
        return (
            f"world size: checkpoint {saved.get('world_size')}, now {current['world_size']}. The data order and "
            "optimizer shards are per rank: resume with the same number of ranks, or start a new run from the "
            "weights (DeepSpeed's deepspeed/utils/zero_to_fp32.py turns a checkpoint into a state dict; for ZeRO "
            "stage changes too see DeepSpeed's universal checkpoint, checkpoint/ds_to_universal.py)"
        )
    ours, theirs = current["config"], saved.get("config", {})
    for key in sorted(set(ours) | set(theirs)):
        if key in OPERATIONAL_KEYS:  # written by an older version, which kept it
            continue
        if ours.get(key, "absent") != theirs.get(key, "absent"):
            return (
                f"{key}: checkpoint {json.dumps(theirs.get(key, 'absent'))}, config "
                f"{json.dumps(ours.get(key, 'absent'))}"
            )
    data, theirs_data = current.get("data"), saved.get("data")
    if data and theirs_data:
        if data["vocabulary"] != theirs_data["vocabulary"]:
            return (
                f"the vocabulary differs from the checkpoint's ({theirs_data['vocabulary']}, now "
                f"{data['vocabulary']}): the tokenizer the run started with has changed or was rebuilt differently; "
                "resume with that tokenizer (data.tokenizer), or start a new run"
            )
        if data["samples"] != theirs_data["samples"]:
            return (
                f"the training samples differ from the checkpoint's ({theirs_data['samples']}, now "
                f"{data['samples']}): the corpus or labelled files have changed since the run started; resume "
                "with the same data, or start a new run"
            )
    return None


def check_resumable(root: str, run_id: Optional[str], current: dict) -> None:
    """The newest complete checkpoint of run ``run_id`` under ``root`` against this run's :func:`identity`: one line
    naming the first difference, or nothing."""
    tags = run_tags(root, run_id)
    if not tags:
        raise BertOptError(f"--resume: {root} holds no complete checkpoint of run {run_id}")
    saved = read_marker(root, tags[0]).get("identity")
    problem = identity_mismatch(saved, current) if saved is not None else None
    if problem:
        raise BertOptError(f"cannot resume {tags[0]}: {problem}")


def read_marker(root: str, tag: str) -> dict:
    with open(os.path.join(root, tag, MARKER), encoding="utf-8") as fh:
        return json.load(fh)


def run_tags(root: str, run_id: Optional[str]) -> list[str]:
    """Complete checkpoints of run ``run_id`` (all of them when the run has no id), newest first."""
    tags = complete_tags(root)
    if run_id is None:
        return tags
    return [t for t in tags if read_marker(root, t).get("identity", {}).get("run_id") in (run_id, None)]


def load(engine, root: str, *, rank: int, run_id: Optional[str] = None) -> Optional[dict]:
    """Load the newest loadable complete checkpoint of run ``run_id``; returns its client state (with ``tag``).

    Collective: ranks agree on success after each attempt so that all load the same one.
    """
    tags = run_tags(root, run_id)
    if not tags:
        raise BertOptError(f"no complete checkpoint of this run under {root}")
    latest_path = os.path.join(root, LATEST)
    latest = open(latest_path, encoding="utf-8").read().strip() if os.path.isfile(latest_path) else None
    if latest != tags[0]:
        print0(
            f"checkpoint pointer 'latest' names {latest!r}, which is missing, partial or older; "
            f"falling back to the newest complete checkpoint {tags[0]}"
        )
    for tag in tags:
        client, error = None, None
        try:
            path, client = engine.load_checkpoint(root, tag=tag, load_lr_scheduler_states=True)
            if path is None:
                error = "DeepSpeed found nothing to load"
            else:
                set_rng_state(load_rng_state(os.path.join(root, tag, f"rng_rank{rank}.pt")))
        except Exception as exc:  # corrupt or truncated files: try the next older checkpoint
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        ok = torch.tensor([0.0 if error else 1.0], device=engine.device)  # NCCL reduces accelerator tensors only
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        if ok.item() == 1.0:
            client = dict(client or {})
            client["tag"] = tag
            return client
        print0(f"checkpoint {tag} could not be loaded ({error or 'failed on another rank'}); trying an older one")
    raise BertOptError(f"none of the checkpoints under {root} could be loaded")
