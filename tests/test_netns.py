"""The network-namespace helper: connectivity, the tbf rate limit, and cleanup in every exit path."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ds_bertopt.testing.netns import NetNamespaces, _namespaces, netns_unavailable_reason, remove_stale

REASON = netns_unavailable_reason(need_tc=True)
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PORT = 29411

# Receiver: accept one connection, read until EOF, print "<bytes> <seconds from first byte>".
SERVER = textwrap.dedent("""
    import socket, sys, time
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    total, start = 0, None
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        start = start or time.perf_counter()
        total += len(chunk)
    conn.sendall(b"ok")
    conn.close()
    print(total, time.perf_counter() - start, flush=True)
""")

# Sender: connect (retrying while the server starts), send N bytes, wait for "ok".
CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(100):
        try:
            sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); break
        except OSError:
            time.sleep(0.1)
    sock.sendall(b"x" * int(sys.argv[3])); sock.shutdown(socket.SHUT_WR)
    assert sock.recv(2) == b"ok"
""")


def transfer(net: NetNamespaces, src: int, dst: int, nbytes: int) -> tuple[int, float]:
    server = net.run(
        dst, [sys.executable, "-c", SERVER, net.addresses[dst], str(PORT)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline().strip() == "ready"
    client = net.run(src, [sys.executable, "-c", CLIENT, net.addresses[dst], str(PORT), str(nbytes)])
    assert client.wait(timeout=60) == 0
    received, seconds = server.stdout.readline().split()
    server.wait(timeout=10)
    return int(received), float(seconds)


def ours(net: NetNamespaces) -> list[str]:
    mine = set(net.names) | ({net.bridge_namespace} if net.bridge_namespace else set())
    return [name for name in _namespaces() if name in mine]


@pytest.mark.timeout(60)
def test_two_namespaces_tcp_across_and_cleanup():
    with NetNamespaces(2) as net:
        assert sorted(ours(net)) == sorted(net.names)
        assert transfer(net, 0, 1, 100_000)[0] == 100_000
        assert transfer(net, 1, 0, 1000)[0] == 1000
    assert ours(net) == []


@pytest.mark.timeout(60)
def test_bridge_joins_more_than_two():
    with NetNamespaces(3) as net:
        assert net.bridge_namespace in _namespaces()
        assert transfer(net, 0, 2, 50_000)[0] == 50_000
        assert transfer(net, 2, 1, 50_000)[0] == 50_000
    assert ours(net) == []


@pytest.mark.timeout(90)
def test_tbf_limits_throughput():
    rate_bits = 50e6
    with NetNamespaces(2, rate="50mbit") as net:
        out = net.run(0, ["tc", "qdisc", "show", "dev", net.ifname], stdout=subprocess.PIPE, text=True)
        assert "tbf" in out.communicate(timeout=10)[0]
        nbytes = 4_000_000
        received, seconds = transfer(net, 0, 1, nbytes)
    assert received == nbytes
    # an upper bound only: a busy machine can make the transfer slower, never faster than the wire
    assert received * 8 / seconds <= 1.5 * rate_bits, (
        f"{received * 8 / seconds / 1e6:.0f} Mbit/s through a 50 Mbit/s link"
    )


@pytest.mark.timeout(60)
def test_cleanup_on_exception_and_processes_are_stopped():
    with pytest.raises(KeyError):
        with NetNamespaces(2) as net:
            sleeper = net.run(0, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise KeyError("boom")
    assert ours(net) == []
    assert sleeper.poll() is not None


@pytest.mark.timeout(60)
def test_cleanup_on_sigterm():
    holder = textwrap.dedent("""
        import sys, time
        from ds_bertopt.testing.netns import NetNamespaces
        with NetNamespaces(3, rate="1gbit") as net:
            print(" ".join(net.names + [net.bridge_namespace]), flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 4 and all(name in _namespaces() for name in names)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not set(names) & set(_namespaces())


@pytest.mark.timeout(60)
def test_remove_stale_deletes_namespaces_of_dead_processes():
    holder = (
        "from ds_bertopt.testing.netns import NetNamespaces; import time\n"
        "net = NetNamespaces(2).__enter__(); print(' '.join(net.names), flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    proc.kill()  # SIGKILL: no cleanup can run
    proc.wait(timeout=10)
    time.sleep(0.1)
    assert set(names) <= set(_namespaces())
    assert set(names) <= set(remove_stale())
    assert not set(names) & set(_namespaces())
