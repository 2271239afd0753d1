"""Long work done by some ranks while the others wait, with no collective timeout to kill the wait.

A rank that waited for a peer's long work in a collective (a barrier, a broadcast) failed after
``train.dist_timeout_s`` with a message about the network, although nobody was dead: local rank 0 was building the
data (or measuring the ``wtacrs.preset: "auto"`` candidates). Here the worker publishes its progress, its end and its
result in the job's key-value store (the rendezvous ``TCPStore``), and the others poll it:

* :class:`Work` (the worker): a heartbeat thread publishes ``stage, k of n shards, elapsed`` every
  :data:`HEARTBEAT_S`; the end is published once: a JSON result, or the worker's own one-line error (a
  :class:`~ds_bertopt.errors.BertOptError`'s line, a full disk named with its file).
* :func:`wait_for` (everyone else): polls the keys it needs; prints ``waiting for node 1's data build: tokenizing
  train documents, 3 of 16 shards, 1m05s elapsed, about 2m10s left`` after :data:`FIRST_REPORT_S` and then every
  :data:`REPORT_EVERY_S`; raises the worker's error as the same line on every waiting rank
  (:class:`~ds_bertopt.errors.JobError`), and a :class:`~ds_bertopt.errors.JobError` naming the worker when its
  heartbeat stopped for ``stale_s`` (its process died: the only timeout left, and it applies to a silent worker,
  never to a slow one).

Without a store (one process) :class:`Work` prints its own progress line every :data:`REPORT_EVERY_S` instead.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from typing import Callable, Optional

from .errors import BertOptError, JobError

HEARTBEAT_S = 5.0
"""How often a worker publishes its progress (and proves it is alive)."""
REPORT_EVERY_S = 30.0
"""How often a waiting rank (or a worker without a store) prints a progress line."""
FIRST_REPORT_S = 3.0
"""A wait shorter than this prints nothing."""
LINGER_S = 3.0
"""A worker that failed waits this long before raising: the waiting ranks poll at least every second, and the store
may live in the worker's process (rank 0), which exits with the error."""
_PREFIX = "ds_bertopt/work/"


def job_store():
    """The job's key-value store: the one the default process group was created with (torch's
    ``distributed_c10d._get_default_store``; ``ds_bertopt.dist.init_distributed`` passes its rendezvous
    ``TCPStore``), or None without a process group of more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def duration(seconds: float) -> str:
    """``"45s"``, ``"2m05s"``, ``"1h02m"``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def describe_progress(progress: dict, since_s: float = 0.0) -> str:
    """``"tokenizing train documents, 3 of 16 shards, 1m05s elapsed, about 2m10s left of this stage"`` from a
    published snapshot taken ``since_s`` seconds ago (the estimate: this stage's pace over its finished shards)."""
    parts = [progress.get("stage") or "starting"]
    done, total = progress.get("done", 0), progress.get("total", 0)
    if total:
        parts.append(f"{done} of {total} {progress.get('unit', 'shards')}")
    parts.append(f"{duration(progress.get('elapsed', 0.0) + since_s)} elapsed")
    if total and done:
        left = progress.get("stage_elapsed", 0.0) * (total - done) / done - since_s
        parts.append(f"about {duration(max(0.0, left))} left of this stage")
    return ", ".join(parts)


def one_line(exc: BaseException) -> str:
    """An exception as the one line users see: a BertOptError's own line; a full disk with its file."""
    if isinstance(exc, BertOptError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {exc.filename or 'a file being written'} ({exc.strerror})"
    first = (str(exc).splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Work:
    """The worker's side of a hand-off (a context manager): progress through :meth:`stage` and :meth:`advance`, the
    end through :meth:`finish` (a JSON-able result) or an exception leaving the block (its :func:`one_line`,
    published, then re-raised here)."""

    def __init__(
        self,
        store,
        name: str,
        what: str,
        say: Optional[Callable[[str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.name, self.what, self.say, self.clock = store, name, what, say, clock
        self.key = _PREFIX + name
        self.started = self.stage_started = clock()
        self.progress = {"stage": "", "done": 0, "total": 0, "unit": "shards"}
        self.durations: dict[str, float] = {}
        """Seconds spent in each finished stage (for the record)."""
        self.beat = 0
        self.ended = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reported = self.started

    def __enter__(self) -> "Work":
        self._publish()
        if self.store is not None or self.say is not None:
            self._thread = threading.Thread(target=self._heartbeat, name=f"ds_bertopt {self.name}", daemon=True)
            self._thread.start()
        return self

    def stage(self, name: str, total: int = 0, unit: str = "shards") -> None:
        """A new stage of ``total`` units (0: not counted)."""
        with self._lock:
            now = self.clock()
            if self.progress["stage"]:
                self.durations[self.progress["stage"]] = self.durations.get(self.progress["stage"], 0.0) + (
                    now - self.stage_started
                )
            self.progress = {"stage": name, "done": 0, "total": total, "unit": unit}
            self.stage_started = now

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.progress["done"] += count

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            return {
                **self.progress,
                "elapsed": now - self.started,
                "stage_elapsed": now - self.stage_started,
                "beat": self.beat,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }

    def _publish(self) -> None:
        self.beat += 1
        if self.store is not None:
            self.store.set(self.key + "/progress", json.dumps(self.snapshot()))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S if self.store is not None else 1.0):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store went away (rank 0 exited): the main thread will say why
                return
            if self.say is not None and self.clock() - self._reported >= REPORT_EVERY_S:
                self._reported = self.clock()
                self.say(f"{self.what}: {describe_progress(self.snapshot())}")

    def _end(self, record: dict) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.store is not None and not self.ended:
            self.store.set(self.key + "/end", json.dumps(record))
        self.ended = True

    def finish(self, result=None) -> None:
        """Publish success and ``result`` (JSON-able) to the waiting ranks."""
        self._end({"ok": True, "result": result})

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.ended:
            return
        record = {"ok": True, "result": None} if exc is None else {"ok": False, "error": one_line(exc)}
        try:
            self._end(record)
        except Exception:  # noqa: BLE001 - the store is gone too (rank 0 exited): the original error matters
            if exc is None:
                raise
            return
        if exc is not None and self.store is not None:
            time.sleep(LINGER_S)


def wait_for(
    store,
    names: list[str],
    labels: dict[str, str],
    *,
    stale_s: float,
    keys: Optional[list[str]] = None,
    say: Optional[Callable[[str], None]] = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Wait until every work in ``names`` has ended (or, with ``keys``, until those store keys exist, the works in
    ``names`` watched meanwhile); returns ``{name: result}`` of the ended works. ``labels[name]`` names a work in
    lines (``"node 1's data build"``). Raises :class:`~ds_bertopt.errors.JobError` with a worker's own line when its
    work failed, or naming it when its heartbeat stopped for ``stale_s``. ``say`` prints the progress lines (None:
    this rank stays quiet)."""
    started = clock()
    next_report = started + FIRST_REPORT_S
    seen: dict[str, tuple[int, float]] = {}  # name -> (last beat, when it changed, by our clock)
    results: dict = {}
    interval = 0.02
    while True:
        for name in names:
            if name in results:
                continue
            end_key = _PREFIX + name + "/end"
            if store.check([end_key]):
                record = json.loads(store.get(end_key))
                if not record["ok"]:
                    raise JobError(record["error"])
                results[name] = record.get("result")
        pending = [n for n in names if n not in results]
        if keys is not None and store.check(keys):
            return results
        if not pending:
            if keys is None:
                return results
            raise JobError(f"{', '.join(labels[n] for n in names)} ended without publishing {', '.join(keys)}")
        now = clock()
        progress = {}
        for name in pending:
            key = _PREFIX + name + "/progress"
            snapshot = json.loads(store.get(key)) if store.check([key]) else None
            progress[name] = snapshot
            beat = snapshot["beat"] if snapshot else 0
            if name not in seen or seen[name][0] != beat:
                seen[name] = (beat, now)
            elif now - seen[name][1] > stale_s:
                where = f" on {snapshot['host']} (pid {snapshot['pid']})" if snapshot else ""
                last = f"; its last report: {describe_progress(snapshot)}" if snapshot else ""
                raise JobError(
                    f"{labels[name]}{where} stopped reporting for {now - seen[name][1]:.0f} s (train.dist_timeout_s "
                    f"{stale_s:g}){last}: its process died or hung; see its output"
                )
        if say is not None and now >= next_report:
            name = pending[0]
            snapshot, since = progress[name], now - seen[name][1]
            say(f"waiting for {labels[name]}: {describe_progress(snapshot, since) if snapshot else 'not started yet'}")
            next_report = now + REPORT_EVERY_S
        interval = min(1.0, interval * 1.5)
        sleep(interval)
