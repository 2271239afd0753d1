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
from typing import Callable

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


_JOBS: list[tuple] = []
"""The parts of the running :func:`parallel_map`, set before its workers fork: they inherit them (the dataset, the
function and its arguments, e.g. a loaded tokenizer) instead of unpickling a copy per part."""


def _map_part(index: int):
    dataset, start, end, function, fn_kwargs, options, cache_file = _JOBS[index]
    part = dataset.select(range(start, end))
    return part.map(function, fn_kwargs={**fn_kwargs, "offset": start}, cache_file_name=cache_file, **options)


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
    **options,
):
    """``dataset.map(function, batched=True, batch_size=...)`` in ``num_proc`` processes, cut at multiples of
    ``align`` only, cached under ``cache_dir/<fingerprint>*.arrow``. ``function`` gets the keyword ``offset``: the
    absolute index of its part's first row (add it to ``with_indices`` indices)."""
    import datasets

    ranges = aligned_ranges(len(dataset), PARTS_PER_PROCESS * num_proc, align) if num_proc > 1 else []
    options = dict(batched=True, batch_size=batch_size, **options)
    if len(ranges) <= 1:
        return dataset.map(
            function,
            fn_kwargs={**fn_kwargs, "offset": 0},
            new_fingerprint=fingerprint,
            cache_file_name=os.path.join(cache_dir, f"{fingerprint}.arrow"),
            desc=desc,
            **options,
        )
    # each worker tokenizes on its one core; forked workers inherit the loaded tokenizer (no re-load)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _JOBS[:] = [
        (
            dataset,
            start,
            end,
            function,
            fn_kwargs,
            {**options, "new_fingerprint": f"{fingerprint}-{start}-{end}", "desc": f"{desc} ({i + 1}/{len(ranges)})"},
            os.path.join(cache_dir, f"{fingerprint}-{start}-{end}.arrow"),
        )
        for i, (start, end) in enumerate(ranges)
    ]
    try:
        with multiprocessing.get_context("fork").Pool(min(num_proc, len(_JOBS))) as pool:
            parts = pool.map(_map_part, range(len(_JOBS)), chunksize=1)
    finally:
        _JOBS.clear()
    return datasets.concatenate_datasets(parts)


__all__ = ["aligned_ranges", "available_cores", "default_num_proc", "parallel_map"]
