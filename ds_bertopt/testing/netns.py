"""Network namespaces joined by virtual links, for multi-"node" tests and benchmarks on one machine.

``with NetNamespaces(2, rate="1gbit") as net:`` creates two namespaces, each with ``lo`` up and one
interface ``net.ifname`` holding ``net.addresses[i]`` (a private 10.x.y.0/24 that exists only
inside these namespaces), joined by a veth pair (2 namespaces) or by a bridge living in a
namespace of its own (more than 2). With ``rate``, every veth end gets
``tc qdisc add ... root tbf rate RATE burst BURST latency LATENCY``, so traffic waits on the
emulated wire while the CPUs stay free. ``net.run(i, argv, env)`` starts a process inside
namespace ``i`` (``ip netns exec``). Everything created is deleted on exit — also on an
exception, on SIGTERM, and at interpreter exit; processes started with ``run`` are stopped first,
and the /dev/shm buffers DeepSpeed left under our addresses are removed
(:func:`remove_deepspeed_shm_buffers`, usable for loopback jobs too).

Names are ``<prefix><pid>n<i>`` (``<prefix><pid>b`` for the bridge namespace), so
:func:`remove_stale` can delete what a killed process (SIGKILL) left behind.

Needs root and iproute2; :func:`netns_available` says whether this machine can, and
:func:`netns_unavailable_reason` why not (for ``pytest.mark.skipif``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Mapping, Optional, Sequence

_instances = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


@functools.lru_cache(maxsize=None)
def netns_unavailable_reason(need_tc: bool = False) -> Optional[str]:
    """``None`` when namespaces (and ``tc``, if asked) can be used here; otherwise why not."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is not installed"
    if need_tc and shutil.which("tc") is None:
        return "tc (iproute2) is not installed"
    probe = f"dsbprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)


def netns_available(need_tc: bool = False) -> bool:
    return netns_unavailable_reason(need_tc) is None


def remove_deepspeed_shm_buffers(master_addr: str, master_port: Optional[object] = None) -> list[str]:
    """Delete the /dev/shm files DeepSpeed's CPU comm op left for a finished job; return their names.

    DeepSpeed 0.19.8 (``shm_initialize`` in ``ops/csrc/cpu/comm/shm.cpp``) creates one
    ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` of ~66 MB per rank
    whenever ``LOCAL_SIZE`` equals the world size, and never unlinks it, so each launcher run
    leaks ~130 MB of RAM. Call once the job's ranks have exited; only that job's files match.
    """
    shm = "/dev/shm"
    stem = f"deepspeed_allreduce_buffer_{os.getuid()}_{master_addr}_"
    stem += f"{master_port}_" if master_port is not None else ""
    try:
        names = [n for n in os.listdir(shm) if n.startswith(stem) and n[len(stem) :].replace("_", "").isdigit()]
    except OSError:
        return []
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm, name))
    return names


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def remove_stale(prefix: str = "dsb") -> list[str]:
    """Delete namespaces named by this module whose creating process no longer exists."""
    removed = []
    for name in _namespaces():
        match = re.fullmatch(re.escape(prefix) + r"(\d+)(?:i\d+)?(?:n\d+|b)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class NetNamespaces:
    """``count`` namespaces on one private /24, optionally rate-limited (see module docstring)."""

    def __init__(
        self,
        count: int = 2,
        *,
        prefix: str = "dsb",
        rate: Optional[str] = None,
        burst: str = "256kb",
        latency: str = "50ms",
        ifname: str = "dsb0",
    ):
        if count < 2:
            raise ValueError(f"NetNamespaces: need at least 2 namespaces, got {count}")
        if count > 250:
            raise ValueError(f"NetNamespaces: at most 250 namespaces on one /24, got {count}")
        instance = next(_instances)
        pid = os.getpid()
        stem = f"{prefix}{pid}" + (f"i{instance}" if instance else "")
        self.names = [f"{stem}n{i}" for i in range(count)]
        """Namespace names, as ``ip netns`` knows them."""
        self.bridge_namespace = f"{stem}b" if count > 2 else None
        self.ifname = ifname
        """The interface name inside every namespace (for ``GLOO_SOCKET_IFNAME``)."""
        subnet = f"10.{200 + (pid >> 8) % 50}.{(pid + instance) % 256}"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(count)]
        """IPv4 address of namespace ``i``."""
        self.rate, self.burst, self.latency = rate, burst, latency
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._previous_sigterm = None
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> "NetNamespaces":
        reason = netns_unavailable_reason(need_tc=self.rate is not None)
        if reason:
            raise RuntimeError(f"NetNamespaces: {reason}")
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_sigterm(self, signum, frame):
        self.close()
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, dev: str) -> None:
        if self.rate is not None:
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    self.rate,
                    "burst",
                    self.burst,
                    "latency",
                    self.latency,
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )

    def _build(self) -> None:
        for name in self.names:
            self._add_namespace(name)
        if self.bridge_namespace is None:
            a, b = self.names
            _ip("link", "add", self.ifname, "netns", a, "type", "veth", "peer", "name", self.ifname, "netns", b)
        else:
            bridge_ns = self.bridge_namespace
            self._add_namespace(bridge_ns)
            _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge_ns, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                port = f"port{i}"
                _ip("link", "add", self.ifname, "netns", name, "type", "veth", "peer", "name", port, "netns", bridge_ns)
                _ip("-n", bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", bridge_ns, "link", "set", port, "up")
                self._shape(bridge_ns, port)
        for name, address in zip(self.names, self.addresses):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", self.ifname)
            _ip("-n", name, "link", "set", self.ifname, "up")
            self._shape(name, self.ifname)

    def close(self) -> None:
        """Stop processes started with :meth:`run`, delete every namespace created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        if self._created:  # DeepSpeed jobs mastered at our addresses leak shm buffers named by them
            for address in self.addresses:
                remove_deepspeed_shm_buffers(address)
        self._created.clear()
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        atexit.unregister(self.close)

    # -- use ------------------------------------------------------------------------------------
    def exec_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``index``."""
        return ["ip", "netns", "exec", self.names[index], *argv]

    def run(
        self, index: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, **popen_kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``index`` (``env`` replaces the environment if given)."""
        if self._closed or not self._created:
            raise RuntimeError("NetNamespaces.run: the namespaces do not exist (outside the with block?)")
        proc = subprocess.Popen(self.exec_argv(index, argv), env=dict(env) if env is not None else None, **popen_kwargs)
        self._procs.append(proc)
        return proc
