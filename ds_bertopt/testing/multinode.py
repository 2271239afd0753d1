"""Simulate an N-node ``deepspeed --hostfile`` job on one machine (one launcher process per node).

Each simulated node is a real ``deepspeed --hostfile H --no_ssh --node_rank i --master_addr A
--master_port P script …`` process, exactly what a scheduler that starts one launcher per node
runs. The hostfile names ``worker-0 … worker-{N-1}`` with ``slots=RANKS_PER_NODE``. All launchers
are waited for; as soon as one fails the others are stopped (process groups, so no orphan ranks
stay behind), and the result says which node failed.

Command line (also ``launch/local_multinode.sh``)::

    python -m ds_bertopt.testing.multinode NODES RANKS_PER_NODE -- launch/pretrain.py --deepspeed_config ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .distributed import free_port


@dataclass
class NodeResult:
    node_rank: int
    returncode: int
    output: str


def write_hostfile(path: str, slots: Sequence[int]) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for i, n in enumerate(slots):
            fh.write(f"worker-{i} slots={n}\n")
    return path


def _pump(stream, node: int, sink: list[str], echo: bool) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if echo:
            sys.stdout.write(f"[node {node}] {line}")
            sys.stdout.flush()
    stream.close()


def run_local_multinode(
    nodes: int,
    ranks_per_node: int,
    script_args: Sequence[str],
    *,
    env: Optional[dict] = None,
    timeout: float = 600,
    master_port: Optional[int] = None,
    slots: Optional[Sequence[int]] = None,
    per_node_slots: Optional[Sequence[Sequence[int]]] = None,
    master_addr: str = "127.0.0.1",
    echo: bool = False,
    cwd: Optional[str] = None,
    node_prefix: Optional[Sequence[Sequence[str]]] = None,
    node_args: Optional[Sequence[Sequence[str]]] = None,
) -> list[NodeResult]:
    """Run ``script_args`` as a ``nodes`` × ``ranks_per_node`` job; return one result per node.

    ``slots`` overrides the hostfile's slot counts (e.g. to test a mis-declared topology);
    ``per_node_slots`` gives each launcher its own hostfile (a cluster whose nodes disagree).
    ``node_prefix[i]`` is prepended to node i's command (e.g. ``ip netns exec NS``); ``node_args[i]`` is appended
    to node i's script arguments (nodes that differ, e.g. each its own ``-o data.cache_dir=...``).
    """
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError("nodes and ranks_per_node must be positive")
    port = master_port or free_port()
    tmp = tempfile.mkdtemp(prefix="dsb_multinode_")
    hostfiles = []
    for i in range(nodes):
        node_slots = (per_node_slots[i] if per_node_slots else slots) or [ranks_per_node] * nodes
        hostfiles.append(write_hostfile(os.path.join(tmp, f"hostfile{i}"), node_slots))
    full_env = {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **(env or {}),
    }
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    procs, outputs, pumps = [], [], []
    for i in range(nodes):
        cmd = [
            deepspeed,
            "--hostfile",
            hostfiles[i],
            "--no_ssh",
            "--node_rank",
            str(i),
            "--master_addr",
            master_addr,
            "--master_port",
            str(port),
            *script_args,
            *(node_args[i] if node_args else ()),
        ]
        if node_prefix:
            cmd = [*node_prefix[i], *cmd]
        proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        sink: list[str] = []
        pump = threading.Thread(target=_pump, args=(proc.stdout, i, sink, echo), daemon=True)
        pump.start()
        procs.append(proc)
        outputs.append(sink)
        pumps.append(pump)
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), failed)
    finally:
        timed_out = any(p.poll() is None for p in procs) and failed is None
        for proc in procs:
            _stop(proc)
        for pump in pumps:
            pump.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)  # the hostfiles; a test's /tmp stays as it found it
    results = [NodeResult(i, p.returncode, "".join(outputs[i])) for i, p in enumerate(procs)]
    if timed_out:
        for r in results:
            r.output += f"\n[local_multinode] timed out after {timeout:.0f} s\n"
    return results


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's whole process group, then SIGKILL what is left."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks a dead launcher may have left
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or len(argv[: argv.index("--")]) != 2:
        print("usage: local_multinode NODES RANKS_PER_NODE -- SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    nodes, rpn = (int(x) for x in argv[: argv.index("--")])
    script = argv[argv.index("--") + 1 :]
    start = time.monotonic()
    results = run_local_multinode(nodes, rpn, script, echo=True, timeout=float(os.environ.get("TIMEOUT", 86400)))
    bad = [r for r in results if r.returncode != 0]
    for r in results:
        print(f"[local_multinode] node {r.node_rank}: exit code {r.returncode}")
    print(
        f"[local_multinode] {nodes} node(s) × {rpn} rank(s): {'FAILED' if bad else 'ok'} "
        f"in {time.monotonic() - start:.1f} s"
    )
    if not bad:
        return 0
    code = bad[0].returncode
    return code if 0 < code < 256 else 1  # killed by a signal: report a plain failure


if __name__ == "__main__":
    sys.exit(main())
