"""Who builds one data cache: this node alone, or every node of the job that sees the same ``data.cache_dir``.

Each node's local rank 0 writes a file into ``<cache_dir>/.nodes/<job>/`` and looks for the other nodes' files
(:func:`sharing_nodes`). Nodes that see the same set of files share the directory (shared storage, e.g. NFS or
Lustre): they form one :class:`Crew` and build the cache together, each node a disjoint set of the shards
(:class:`~.parallel.Share`), and every node opens the assembled result. A node that sees only its own file is on
node-local storage and builds its own copy, as it did before; the log says which case was detected.

The crew's nodes agree through the job's store (:mod:`ds_bertopt.handoff`): the leader (the lowest node) decides
what is built and writes the stored fingerprint; the others wait for its decisions and for each other's shards,
watching the heartbeats of the nodes they wait on, so a node that fails stops the others with its own line.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from ..handoff import wait_for
from .parallel import Share

PROBE_DIR = ".nodes"
"""Under ``data.cache_dir``: one folder per job, one empty file per node (removed once every node has looked)."""
PROBE_RETRIES = 5
"""Looks at another node's file before calling it invisible (network filesystems may show a new file late)."""
STALE_PROBES_S = 86400
"""Probe folders older than this (jobs killed while probing) are removed."""
_KEY = "ds_bertopt/data/"


def work_name(node: int) -> str:
    """The :class:`~ds_bertopt.handoff.Work` of a node's data build (its local rank 0)."""
    return f"data/node{node}"


def work_labels(num_nodes: int) -> dict[str, str]:
    return {work_name(n): f"node {n}'s data build" for n in range(num_nodes)}


@dataclass
class Crew:
    """The nodes that build one cache directory (one node, or every node that shares it), from one node's side."""

    nodes: tuple[int, ...] = (0,)
    """Node ranks of the crew, ascending; the first is its leader."""
    node: int = 0
    """This node."""
    store: object = None
    """The job's store (None: one process, nothing to agree on)."""
    stale_s: float = 120.0
    """A node whose heartbeat stops this long is given up on (``train.dist_timeout_s``)."""
    say: Optional[Callable[[str], None]] = None
    """Where this node's waiting lines go (None: quiet)."""
    procs: tuple[int, ...] = (1,)
    """``data.num_proc`` of every node of the crew (set once they are known: :meth:`gather`)."""

    @property
    def solo(self) -> bool:
        return len(self.nodes) == 1

    @property
    def is_leader(self) -> bool:
        return self.node == self.nodes[0]

    def _wait(self, nodes, keys: list[str]) -> None:
        labels = work_labels(max(self.nodes) + 1)
        wait_for(self.store, [work_name(n) for n in nodes], labels, keys=keys, stale_s=self.stale_s, say=self.say)

    def agree(self, name: str, decide: Callable[[], str]) -> str:
        """The leader's ``decide()``, on every node of the crew."""
        if self.solo:
            return decide()
        key = f"{_KEY}{name}/leader"
        if self.is_leader:
            value = decide()
            self.store.set(key, value)
            return value
        self._wait([self.nodes[0]], [key])
        return self.store.get(key).decode()

    def gather(self, name: str, value: str) -> list[str]:
        """Every node's ``value``, in crew order (this node's published first)."""
        if self.solo:
            return [value]
        self.store.set(f"{_KEY}{name}/node{self.node}", value)
        others = [n for n in self.nodes if n != self.node]
        self._wait(others, [f"{_KEY}{name}/node{n}" for n in others])
        return [self.store.get(f"{_KEY}{name}/node{n}").decode() for n in self.nodes]

    def wait_others(self, stage: str) -> None:
        """Say this node finished its shards of ``stage``; return when every node of the crew has."""
        self.gather(f"done/{stage}", "1")

    def share(self) -> Optional[Share]:
        """This node's share of a stage's parts (None alone: every part is this node's)."""
        return None if self.solo else Share(self.procs, self.nodes.index(self.node), self.wait_others)


def visible_nodes(folder: str, node: int, others: list[int], retries: int = PROBE_RETRIES, pause_s: float = 0.4):
    """This node and the ``others`` whose probe file is in ``folder`` (looked for again a few times, all together)."""
    seen, missing = {node}, list(others)
    for attempt in range(retries):
        missing = [n for n in missing if not os.path.exists(os.path.join(folder, f"node{n}"))]
        if not missing or attempt + 1 == retries:
            break
        time.sleep(pause_s)
    return sorted(seen | (set(others) - set(missing)))


def groups_from_views(views: dict[int, frozenset]) -> dict[int, tuple[int, ...]]:
    """Node → its crew: the nodes whose view (the set of nodes whose files it sees) is the same as its own. Every node
    computes the same crews from the same views, even where a network filesystem showed a file late to one node
    (its view differs: it builds alone, in the same directory, and the build lock orders the two)."""
    return {node: tuple(sorted(n for n, v in views.items() if v == view)) for node, view in views.items()}


def sharing_nodes(store, node: int, num_nodes: int, cache_dir: str, stale_s: float, say=None) -> tuple[int, ...]:
    """The nodes of this job (this one included) that build ``cache_dir`` together (see the module docstring)."""
    job = store.compare_set(f"{_KEY}job", "", uuid.uuid4().hex).decode()  # the first node's id wins, for all
    root = os.path.join(cache_dir, PROBE_DIR)
    folder = os.path.join(root, job)
    os.makedirs(folder, exist_ok=True)
    _remove_stale_probes(root, keep=job)
    mine = os.path.join(folder, f"node{node}")
    open(mine, "w").close()
    everyone = Crew(tuple(range(num_nodes)), node, store, stale_s, say)
    everyone.gather("probe", "1")  # every node's file is written
    others = [n for n in range(num_nodes) if n != node]
    published = everyone.gather("view", json.dumps(visible_nodes(folder, node, others)))
    views = {n: frozenset(json.loads(value)) for n, value in enumerate(published)}
    os.unlink(mine)  # every node has looked
    try:
        os.rmdir(folder)
    except OSError:
        pass  # another node's file is still there: the last one removes the folder
    return groups_from_views(views)[node]


def _remove_stale_probes(root: str, keep: str) -> None:
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if name != keep and now - os.path.getmtime(path) > STALE_PROBES_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def describe_storage(cache_dir: str, node: int, crew: tuple[int, ...]) -> str:
    """The log line that says which case :func:`sharing_nodes` detected."""
    if len(crew) > 1:
        return (
            f"data: data.cache_dir {cache_dir} is shared by nodes {', '.join(map(str, crew))} (each sees the others' "
            "files there): they build it together, each a disjoint set of the shards, and all open the one result"
        )
    return (
        f"data: data.cache_dir {cache_dir} is node {node}'s own (no other node's file is seen there): node {node} "
        "builds its own copy"
    )
