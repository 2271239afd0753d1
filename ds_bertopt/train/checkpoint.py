"""Atomic, resumable checkpoints around ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Layout under ``<output_dir>/checkpoints``: ``stepNNNNNNNN/`` (DeepSpeed's files, ``rng_rank<r>.pt`` and, written
last, ``COMPLETE.json`` with the step, the sampler position and the run's :func:`identity`), ``<tag>.partial/``
(a save in progress or one that died: never loaded) and ``latest`` (replaced atomically). Only when every rank
has saved does local rank 0 of each node mark, rename and switch ``latest``, so a crash at any point leaves the
previous checkpoint complete. Resume loads only checkpoints of the same run whose identity matches the config
given now (:func:`identity_mismatch` names the first difference), falls back to the newest older complete one
when ``latest`` is stale or loading fails on any rank, and says so. The last ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch

from .. import faults
from ..dist import Topology, barrier
from ..errors import BertOptError
from ..log import print0

MARKER = "COMPLETE.json"
LATEST = "latest"
_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


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


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def complete_tags(root: str) -> list[str]:
    """Complete checkpoint tags under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    tags = [name for name in os.listdir(root) if _TAG.match(name) and os.path.isfile(os.path.join(root, name, MARKER))]
    return sorted(tags, reverse=True)


def save(engine, output_dir: str, step: int, client_state: dict, topo: Topology, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    rank, local_rank = topo.rank, topo.local_rank
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    partial = f"{tag}.partial"
    if local_rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(os.path.join(root, partial), ignore_errors=True)  # a dead earlier attempt
    barrier()
    engine.save_checkpoint(root, tag=partial, client_state=client_state, save_latest=False)
    os.makedirs(os.path.join(root, partial), exist_ok=True)
    torch.save(rng_state(), os.path.join(root, partial, f"rng_rank{rank}.pt"))
    faults.inject("save", rank, step)
    barrier()
    final = os.path.join(root, tag)
    kept = ("world_size", "sampler", "identity")
    marker = {"step": step, "tag": tag, **{k: client_state[k] for k in kept if k in client_state}}
    # Global rank 0 finalises first; then the local rank 0 of any node whose filesystem is not
    # shared with rank 0 (it still sees its own ``.partial``) finalises its copy.
    if rank == 0:
        _finalise(root, partial, final, tag, marker, keep_last)
    barrier()
    if rank != 0 and local_rank == 0 and os.path.isdir(os.path.join(root, partial)):
        _finalise(root, partial, final, tag, marker, keep_last)
    barrier()
    return final


def _finalise(root: str, partial: str, final: str, tag: str, marker: dict, keep_last: int) -> None:
    """Mark complete, rename into place, switch ``latest``, prune: in this order."""
    _write_atomic(os.path.join(root, partial, MARKER), json.dumps(marker, indent=1))
    if os.path.isdir(final):  # re-saving the same step (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(os.path.join(root, partial), final)
    _write_atomic(os.path.join(root, LATEST), tag)
    for old in complete_tags(root)[keep_last:]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def resolve_resume_dir(resume: str, output_dir: str) -> str:
    """``--resume`` (``auto`` = this run's output dir) → the checkpoint root; must exist."""
    base = output_dir if resume == "auto" else os.path.abspath(os.path.expanduser(resume))
    root = base if os.path.basename(os.path.normpath(base)) == "checkpoints" else checkpoint_root(base)
    if not os.path.isdir(base):
        raise BertOptError(f"resume directory {base} does not exist")
    if not os.path.isdir(root) or not complete_tags(root):
        raise BertOptError(
            f"resume directory {base} holds no complete checkpoint (checkpoints/stepNNNNNNNN/ with "
            f"{MARKER}); start without --resume"
        )
    return root


# --- run identity -----------------------------------------------------------------------------------
RUN_FILE = "run.json"
# Keys that may differ between a run and its resumption: where and how often it reports, not what it computes;
# and how long it runs (a run may be extended: the LR schedule then spans the new length, and the loop says so).
_TRAIN_KEYS = (
    "max_steps epochs output_dir overwrite_output_dir eval_every eval_each_epoch log_every save_every keep_last"
)
_TRAIN_KEYS += " save_model dataloader_workers dist_timeout_s dist_init_timeout_s log_samples max_consecutive_nonfinite"
_DS_KEYS = "steps_per_print wall_clock_breakdown csv_monitor tensorboard wandb comet flops_profiler comms_logger"
OPERATIONAL_KEYS = (*(f"bertopt.train.{k}" for k in _TRAIN_KEYS.split()), *(f"deepspeed.{k}" for k in _DS_KEYS.split()))


def _flatten(tree, prefix: str, out: dict) -> dict:
    if isinstance(tree, dict) and tree and prefix not in OPERATIONAL_KEYS:
        for key, value in tree.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif prefix not in OPERATIONAL_KEYS:
        out[prefix] = tree
    return out


def identity(run_id: str, world_size: int, described: dict) -> dict:
    """What a checkpoint must share with the run that resumes it (``described``: ``config.describe``)."""
    return {"run_id": run_id, "world_size": world_size, "config": _flatten(described, "", {})}


def identity_mismatch(saved: dict, current: dict) -> Optional[str]:
    """One line naming the first difference between a checkpoint's identity and this run's, or None."""
    if saved.get("world_size") != current["world_size"]:
        return (
            f"world size: checkpoint {saved.get('world_size')}, now {current['world_size']}. The data order and "
            "optimizer shards are per rank: resume with the same number of ranks, or start a new run from the "
            "weights (DeepSpeed's deepspeed/utils/zero_to_fp32.py turns a checkpoint into a state dict; for ZeRO "
            "stage changes too see DeepSpeed's universal checkpoint, checkpoint/ds_to_universal.py)"
        )
    ours, theirs = current["config"], saved.get("config", {})
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key, "absent") != theirs.get(key, "absent"):
            return (
                f"{key}: checkpoint {json.dumps(theirs.get(key, 'absent'))}, config "
                f"{json.dumps(ours.get(key, 'absent'))}"
            )
    return None


def read_run_id(output_dir: str) -> Optional[str]:
    path = os.path.join(output_dir, RUN_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get("run_id")


def write_run_id(output_dir: str, run_id: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    _write_atomic(os.path.join(output_dir, RUN_FILE), json.dumps({"run_id": run_id}))


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
