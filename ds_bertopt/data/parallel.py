"""``datasets.map`` over several processes with a result that does not depend on how many (``data.num_proc``).

The sequence builder seeds its random draws per map batch (from the batch's first index) and pairs NSP segments
within a batch, so its output depends on where batches start. ``datasets``' own ``num_proc`` cuts the dataset into
equal shards wherever that falls; :func:`aligned_ranges` cuts it only at multiples of ``align`` (the map batch for
the sequence builder; 1 for tokenization, which is per document), so every batch holds the documents it holds in
one process. The dataset is cut into a few parts per process, which the (forked) processes take as they finish
(documents of very different sizes still share out evenly), each mapped with its absolute offset. The parts are
concatenated in order: the same rows, bit for bit, for any process count, so nodes with other core counts build
the same data (their fingerprints agree, :mod:`.identity`). Each part is cached under its own file; a second build
with the same process count reuses them.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from dataclasses import dataclass
from typing import Callable, Optional

from .. import faults

MIN_BYTES_PER_PROCESS = 4 << 20
"""The default gives a process at least this much text (about 700k words, seconds of one core's tokenizing): a
smaller corpus stays in one process, where starting processes would cost more than they save."""
PARTS_PER_PROCESS = 8
"""Parts the dataset is cut into per process (taken as processes finish: uneven documents still balance)."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity, e.g. a scheduler's allocation), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_num_proc(text_bytes: int, cores: int) -> int:
    """``data.num_proc`` when not given: every core of the node (local rank 0 builds while the other ranks wait), but
    one process per :data:`MIN_BYTES_PER_PROCESS` of text at most."""
    return max(1, min(cores, text_bytes // MIN_BYTES_PER_PROCESS))


def aligned_ranges(num_items: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``num_items`` in order, every start a multiple of ``align``, the aligned
    blocks shared out as evenly as possible among at most ``parts`` ranges (fewer when there are fewer blocks)."""
    blocks = math.ceil(num_items / align)
    parts = max(1, min(parts, blocks))
    bounds = [round(i * blocks / parts) * align for i in range(parts)] + [num_items]
    return [(a, min(b, num_items)) for a, b in zip(bounds, bounds[1:]) if a < min(b, num_items)]


@dataclass(frozen=True)
class Share:
    """This node's share of work cut into parts for the nodes that build one cache directory together (see
    :mod:`.crew`): part ``i`` belongs to the node owning process slot ``i mod sum(procs)`` (every node computes the
    same parts and the same owners)."""

    procs: tuple[int, ...]
    """``data.num_proc`` of every node of the group, in group order."""
    index: int
    """This node's position in the group."""
    wait: Callable[[str], None]
    """``wait(stage)``: says this node wrote its parts of ``stage`` and returns when every other node has too."""

    def owned(self, parts: int) -> list[int]:
        slots = [node for node, count in enumerate(self.procs) for _ in range(count)]
        return [i for i in range(parts) if slots[i % len(slots)] == self.index]


_JOBS: list[tuple] = []
"""The jobs of the running :func:`run_parts`, set before its workers fork: they inherit them (the dataset, the
function and its arguments, e.g. a loaded tokenizer) instead of unpickling a copy per part."""
_RUN_BEFORE = [0]
"""Parts this process ran in earlier :func:`run_parts` calls: the fault point ``build``'s step is a part's number in
this process's whole build (1: its first part, whichever stage)."""


def _run_job(index: int):
    function, args = _JOBS[index]
    step = _RUN_BEFORE[0] + index + 1
    faults.inject("build", int(os.environ.get("RANK", "0") or 0), step)  # tests: a slow or failing build
    return index, function(*args)


def run_parts(jobs: list[tuple[Callable, tuple]], num_proc: int, progress=None) -> list:
    """``function(*args)`` of every job, in ``num_proc`` forked processes (inline for one), results in job order;
    ``progress.advance()`` as each ends."""
    results: list = [None] * len(jobs)
    _JOBS[:] = jobs
    try:
        if num_proc <= 1 or len(jobs) <= 1:
            finished = map(_run_job, range(len(jobs)))
            for index, result in finished:
                results[index] = result
                if progress is not None:
                    progress.advance()
        else:
            # each worker works on its one core; forked workers inherit the loaded tokenizer (no re-load)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            with multiprocessing.get_context("fork").Pool(min(num_proc, len(jobs))) as pool:
                for index, result in pool.imap_unordered(_run_job, range(len(jobs)), chunksize=1):
                    results[index] = result
                    if progress is not None:
                        progress.advance()
    finally:
        _RUN_BEFORE[0] += len(jobs)
        _JOBS.clear()
    return results


def _map_part(dataset, start, end, function, fn_kwargs, options, cache_file):
    part = dataset.select(range(start, end))
    part.map(function, fn_kwargs={**fn_kwargs, "offset": start}, cache_file_name=cache_file, **options)
    return cache_file


def part_ranges(num_items: int, procs: int, align: int) -> list[tuple[int, int]]:
    """The parts a dataset is cut into for ``procs`` processes in all (every node of a group computes the same)."""
    return aligned_ranges(num_items, PARTS_PER_PROCESS * procs, align) or [(0, num_items)]


def parallel_map(
    dataset,
    function: Callable,
    *,
    num_proc: int,
    align: int,
    batch_size: int,
    fingerprint: str,
    cache_dir: str,
    fn_kwargs: dict,
    desc: str,
    share: Optional[Share] = None,
    progress=None,
    **options,
):
    """``dataset.map(function, batched=True, batch_size=...)`` cut into parts at multiples of ``align`` only, the
    parts mapped in ``num_proc`` processes, each cached as ``cache_dir/<fingerprint>-<start>-<end>.arrow`` (a part
    found there is reused). ``function`` gets the keyword ``offset``: the absolute index of its part's first row (add
    it to ``with_indices`` indices). With ``share`` this node maps only its own parts and waits for the other nodes'
    (``share.wait``); ``progress`` (a :class:`~ds_bertopt.handoff.Work`) counts this node's parts."""
    import datasets

    ranges = part_ranges(len(dataset), sum(share.procs) if share else num_proc, align)
    mine = share.owned(len(ranges)) if share else list(range(len(ranges)))
    files = [os.path.join(cache_dir, f"{fingerprint}-{start}-{end}.arrow") for start, end in ranges]
    options = dict(batched=True, batch_size=batch_size, **options)
    jobs = []
    for i in mine:
        part_options = {**options, "new_fingerprint": f"{fingerprint}-{i}", "desc": f"{desc} ({i + 1}/{len(ranges)})"}
        jobs.append((_map_part, (dataset, *ranges[i], function, fn_kwargs, part_options, files[i])))
    if progress is not None:
        progress.stage(desc, total=len(jobs))
    run_parts(jobs, num_proc, progress)
    if share is not None:
        share.wait(fingerprint)
    parts = [datasets.Dataset.from_file(path) for path in files]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


__all__ = ["Share", "aligned_ranges", "available_cores", "default_num_proc", "parallel_map", "run_parts"]
