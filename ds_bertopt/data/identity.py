"""What every rank trains on, as two digests: the vocabulary and the samples (token ids, labels).

Nodes with their own disks build their own caches; nothing else guarantees that they built the same thing.
At start-up :func:`check_same_data` compares every rank's :class:`DataFingerprint` (one all-gather) and
stops the job, naming both nodes and where their data came from, when one differs; checkpoints keep
:meth:`DataFingerprint.identity`, so a resume compares the vocabulary and samples themselves, not the path of
the cache they came from.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..dist import Topology, all_views
from ..errors import JobError


@dataclass(frozen=True)
class DataFingerprint:
    vocabulary: str
    """Digest of the tokenizer's vocabulary (pieces and ids) and lower-casing."""
    samples: str
    """Digest of the training and evaluation samples (token ids, token types, labels)."""
    where: str
    """Where this rank's data came from, for messages (``data.cache_dir /x``, ``data.tokenizer /y``)."""

    def identity(self) -> dict:
        """What a checkpoint keeps (``where`` may change between a run and its resumption)."""
        return {"vocabulary": self.vocabulary, "samples": self.samples}


def vocabulary_digest(tokenizer) -> str:
    """The vocabulary's pieces and ids, and whether it lower-cases: what the embedding rows mean."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha1(repr(vocab).encode()).hexdigest()[:16]
    return f"{digest}-lc{int(bool(getattr(tokenizer, 'do_lower_case', False)))}"


def array_digest(arrays) -> str:
    """Digest of a sequence of numpy arrays (values and shapes, in order)."""
    h = hashlib.sha1()
    for array in arrays:
        array = np.ascontiguousarray(array)
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes())
    return h.hexdigest()[:16]


def _column_arrays(column):
    """A column (an Arrow ``ChunkedArray``) as :func:`array_digest` sees it, one ``(dtype, length, chunks)`` per
    array: a list column as its list lengths, then its flat values. The chunks are zero-copy numpy views."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = column.chunks
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        sizes = [pc.list_value_length(chunk).to_numpy(zero_copy_only=False) for chunk in chunks]
        yield np.dtype(np.int64 if pa.types.is_large_list(column.type) else np.int32), sizes
        chunks = [pc.list_flatten(chunk) for chunk in chunks]
        column = pa.chunked_array(chunks, type=column.type.value_type)
    yield np.dtype(column.type.to_pandas_dtype()), [chunk.to_numpy(zero_copy_only=False) for chunk in chunks]


def table_digest(table, columns) -> str:
    """Digest of ``columns`` of an Arrow table (list columns: their lengths, then their flat values), chunk by
    chunk: no copy of the table is made (a memory-mapped one stays on disk), and the digest is
    :func:`array_digest` of the whole columns, whatever their chunks."""
    h = hashlib.sha1()
    for name in columns:
        for dtype, arrays in _column_arrays(table.column(name)):
            h.update(f"{dtype.str}{(sum(len(a) for a in arrays),)}".encode())
            for array in arrays:
                h.update(np.ascontiguousarray(array, dtype=dtype).data)
    return h.hexdigest()[:16]


def columns_digest(dataset, columns) -> str:
    """Digest of ``columns`` of a ``datasets.Dataset`` (:func:`table_digest`), read as Arrow (no Python objects per
    row, no copy of the memory-mapped table)."""
    return table_digest(dataset.with_format("arrow")[:], columns)  # [:] honours select()'s index mapping


def sampled_rows(num_rows: int, count: int) -> np.ndarray:
    """``count`` row indices spread evenly over ``num_rows`` (all of them when there are fewer)."""
    return (
        np.unique(np.linspace(0, num_rows - 1, min(num_rows, count)).astype(np.int64))
        if num_rows
        else np.zeros(0, np.int64)
    )


def sampled_digest(dataset, columns, count: int) -> str:
    """:func:`table_digest` of :func:`sampled_rows` of ``dataset``: a cheap check that a cache still holds what it
    held when it was fingerprinted."""
    sampled = dataset.with_format("arrow")[sampled_rows(len(dataset), count)]
    return table_digest(sampled.combine_chunks(), columns)  # a gather gives a chunk per row


def disagreement(views: list[tuple]) -> Optional[str]:
    """``views``: every rank's ``(rank, node, host, DataFingerprint)``; one line naming the first rank whose data
    differs from rank 0's, and both nodes, or None."""
    _, node0, host0, first = views[0]
    for rank, node, host, other in views[1:]:
        if (other.vocabulary, other.samples) == (first.vocabulary, first.samples):
            continue
        if other.vocabulary != first.vocabulary:
            what = f"its vocabulary differs ({other.vocabulary} vs {first.vocabulary})"
        else:
            what = f"its samples differ ({other.samples} vs {first.samples}; the corpus or labelled files differ)"
        return (
            f"node {node} (rank {rank} on {host}, {other.where}) would train on other data than node {node0} "
            f"(rank 0 on {host0}, {first.where}): {what}; every node must read the same tokenizer and data: give "
            "data.tokenizer, or the same files, on every node"
        )
    return None


def check_same_data(fingerprint: DataFingerprint, topo: Topology) -> None:
    """Collective: every rank's fingerprint against rank 0's; the same one line on every rank when one differs."""
    problem = disagreement(all_views((topo.rank, topo.node_rank, socket.gethostname(), fingerprint)))
    if problem:
        raise JobError(problem)
