"""One pre-flight, then work: every check that needs no other rank, before data or model are built and before
anything is written. It runs identically on every rank (its error is printed once, exit status 2) and in
``ds-bertopt config``. In order: our section (strict dataclasses; a key the task does not read is refused unless
``train.allow_unread_keys``), DeepSpeed's part (``engine.prepare_deepspeed_config`` and DeepSpeed's own parser),
the run directory (:mod:`.rundir`: an earlier run is refused unless ``--resume`` continues it or
``train.overwrite_output_dir`` replaces it, once the run starts and holds the directory's lock; anything no run
wrote is refused either way), the checkpoint
to resume and its identity (task, world size, config), then the task's own inputs (corpus or labelled files,
model directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from ..config import RunConfig, dead_keys, describe, load_config, overridden_keys
from ..dist import Topology
from ..engine import prepare_deepspeed_config, refuse_deepspeed_optimizer_blocks
from ..errors import ConfigError
from ..log import print0
from ..mounts import existing_parent
from . import checkpoint, rundir


@dataclass(frozen=True)
class Plan:
    """What the pre-flight settled: the resolved config and where the run reads and writes."""

    cfg: RunConfig
    output_dir: str
    resume_root: Optional[str]
    """Checkpoint root to resume from (``--resume``), or None for a fresh run."""
    run_id: Optional[str]
    """Id of the run being resumed (``output_dir/run.json``); None for a fresh run."""
    writes: tuple = ()
    """The entries of ``output_dir`` this run may create (:func:`.rundir.planned_entries`), recorded in ``run.json``."""


def check_output_dir(output_dir: str, resume: Optional[str], overwrite: bool, writes: list[str]) -> None:
    """The run directory's policy (:mod:`.rundir`): a fresh run needs a new or empty directory, or one holding only an
    earlier run that ``overwrite`` replaces; nothing a run did not write is ever removed or written into."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"train.output_dir: {output_dir} exists and is not a directory")
    if resume is not None and overwrite:
        raise ConfigError("--resume and train.overwrite_output_dir contradict each other; give one")
    foreign = rundir.foreign_entries(output_dir)
    if resume is None and foreign:
        raise ConfigError(rundir.foreign_line(output_dir, foreign))
    clash = [name for name in foreign if name in writes]
    if clash:  # resuming: this run would write into an entry no run wrote
        raise ConfigError(
            f"train.output_dir: {output_dir} holds {rundir.describe_entries(output_dir, clash)}, which this run would "
            "write into but no ds_bertopt run wrote; move it away, or turn off what writes it"
        )
    if resume is None and not overwrite and rundir.holds_run(output_dir):
        raise ConfigError(
            f"train.output_dir: {output_dir} already holds a run; continue it with --resume, replace it "
            "with --overwrite_output_dir, or choose another --output_dir"
        )
    existing = existing_parent(output_dir)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK, effective_ids=True):
        raise ConfigError(f"train.output_dir: cannot create {output_dir} ({existing} is not a writable directory)")


def preflight(
    task,
    config_path: str,
    overrides: list[str],
    topo: Topology,
    device_type: str,
    resume: Optional[str] = None,
    run_dir: bool = True,
) -> Plan:
    """Everything checkable on this rank alone; raises ``BertOptError`` with one line. ``run_dir=False`` (``ds-bertopt
    config``, which writes nothing): the output directory is neither judged nor read."""
    cfg = load_config(config_path, overrides)
    check_keys_are_read(task, cfg)
    check_dead_keys(cfg, overrides)
    refuse_deepspeed_optimizer_blocks(cfg.deepspeed)
    train = cfg.bertopt.train
    if train.max_steps is None and train.epochs is None:
        raise ConfigError("bertopt.train: set max_steps or epochs (how long to train)")
    ds = prepare_deepspeed_config(cfg, topo.world_size, device_type)
    output_dir = os.path.abspath(os.path.expanduser(train.output_dir))
    for monitor in ("csv_monitor", "tensorboard"):
        block = ds.get(monitor)
        if isinstance(block, dict) and block.get("enabled") and not block.get("output_path"):
            block["output_path"] = os.path.join(output_dir, rundir.MONITOR_DIR)
    cfg = cfg.with_deepspeed(ds, resolved_for=topo.world_size)
    writes = rundir.planned_entries(train, ds, output_dir)
    if run_dir:
        check_output_dir(output_dir, resume, train.overwrite_output_dir, writes)
    resume_root = run_id = None
    if resume is not None:
        resume_root = checkpoint.resolve_resume_dir(resume, output_dir)
        run_id = rundir.read_run_id(os.path.dirname(resume_root))
        checkpoint.check_resumable(
            resume_root, run_id, checkpoint.identity(run_id, topo.world_size, describe(cfg), task.name)
        )
    task.preflight(cfg, topo, training=run_dir)
    strategy = cfg.bertopt.sampler.strategy
    if strategy == "packed_node_balance" and not task.skips_padding(cfg):
        print0(
            "note: sampler.strategy packed_node_balance balances real tokens, for kernels that skip padding "
            "(model.unpadded: true); this model computes on padding, which padded_node_balance balances"
        )
    return Plan(cfg=cfg, output_dir=output_dir, resume_root=resume_root, run_id=run_id, writes=writes)


def unread_keys(given, reads) -> list[str]:
    """The keys of ``given`` (dotted, under ``bertopt``) that no prefix in ``reads`` covers, sorted."""
    return sorted(k for k in given if not any(k == r or k.startswith(f"{r}.") for r in reads))


def _refuse_or_note(cfg: RunConfig, keys: list[str], why, accepted: str) -> None:
    """One line naming the first of ``keys`` (sorted) and why (``why(key)``), and how many more; with
    ``train.allow_unread_keys`` a note line instead (``accepted``: what the note says of them)."""
    if not keys:
        return
    if cfg.bertopt.train.allow_unread_keys:
        print0(f"note: {accepted} bertopt.{', bertopt.'.join(keys)} (train.allow_unread_keys)")
        return
    more = f" (and {len(keys) - 1} more: {', '.join(keys[1:4])}{', …' if len(keys) > 4 else ''})"
    raise ConfigError(
        f"bertopt.{keys[0]}: {why(keys[0])}{more if len(keys) > 1 else ''}; remove it, or set "
        "train.allow_unread_keys=true to accept keys this task ignores"
    )


def check_keys_are_read(task, cfg: RunConfig) -> None:
    """A key the task does not read is refused in one line naming it, or, with ``train.allow_unread_keys``, named
    in one note line: a setting that silently does nothing is a silently wrong run."""
    unread = unread_keys(cfg.given, task.reads)

    def why(key: str) -> str:
        hint = task.unread_hints.get(key.split(".")[0], "")
        return f"{task.title} does not read it{f' ({hint})' if hint else ''}"

    _refuse_or_note(cfg, unread, why, f"{task.title} does not read")


def check_dead_keys(cfg: RunConfig, overrides: list[str]) -> None:
    """A key the user set whose value cannot matter under the rest of the config (``dead_fields()`` of its section,
    beside the field; :func:`ds_bertopt.config.dead_keys`) is refused in one line naming it and why, or, with
    ``train.allow_unread_keys``, named in one note line. A key of the file that only the command line's
    ``overrides`` make dead (``-o bucket_clip.enabled=false`` on a file that tunes ``bucket_clip.max_norm``) is
    named in a note: the switch was this run's choice, and the file is checked as it stands."""
    dead = dead_keys(cfg)
    keys = sorted(k for k in cfg.given if k in dead)
    if not keys or not overrides:
        _refuse_or_note(cfg, keys, lambda k: f"has no effect: {dead[k]}", "ignoring")
        return
    typed = set(overridden_keys(overrides))
    try:
        alone = load_config(cfg.path)
        dead_alone = {k for k in dead_keys(alone) if k in alone.given}
    except ConfigError:
        dead_alone = set(keys)
    switched_off = [k for k in keys if k not in typed and k not in dead_alone]
    if switched_off:
        lines = "; ".join(f"bertopt.{k} ({dead[k]})" for k in switched_off)
        print0(f"note: the command line makes {cfg.path}'s {lines} have no effect in this run")
    refused = [k for k in keys if k not in switched_off]
    _refuse_or_note(cfg, refused, lambda k: f"has no effect: {dead[k]}", "ignoring")


def with_total_steps(cfg: RunConfig, total_steps: int) -> RunConfig:
    """``cfg`` with ``train.max_steps`` resolved (the LR schedule spans the real run)."""
    b = cfg.bertopt
    return replace(cfg, bertopt=replace(b, train=replace(b.train, max_steps=total_steps)))
