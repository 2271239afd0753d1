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


def columns_digest(dataset, columns) -> str:
    """Digest of ``columns`` of a ``datasets.Dataset`` (list columns: their lengths and flat values), read as
    Arrow (no Python objects per row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]  # honours select()'s index mapping

    def arrays():
        for name in columns:
            column = table.column(name)
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                yield pc.list_value_length(column).to_numpy()
                column = pc.list_flatten(column)
            yield column.to_numpy()

    return array_digest(arrays())


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
