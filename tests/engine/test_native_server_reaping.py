"""The native server lets go of a finished connection at once: its socket is closed without
waiting for another connection to arrive; and its threads do not grow with connections (a
fixed set of event loops serves them all).

Real peer process, real sockets; the server's threads and descriptors are counted in
/proc/<pid>/task and /proc/<pid>/fd, so no test relies on a hook inside the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from .native_peer import NativePeer, start_peer
from .wire_client import closed_by_server, connect, handshake, send_hello

CLUSTER = 47
CONNECTIONS = 6
REAP_WITHIN_S = 1.0
SETTLE_S = 0.2


@pytest.fixture(scope="module")
def peer() -> Iterator[NativePeer]:
    peer = start_peer(CLUSTER)
    yield peer
    peer.stop()


def threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def settled_counts(pid: int) -> tuple[int, int]:
    """The counts once they stopped changing (an idle server's threads are all parked)."""
    last = threads_and_fds(pid)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = threads_and_fds(pid)
        if now == last:
            return now
        last = now
    return last


def counts_within(pid: int, expected: tuple[int, int], seconds: float) -> tuple[int, int]:
    """Polls until the counts equal `expected` or `seconds` passed; returns the last seen."""
    deadline = time.monotonic() + seconds
    while True:
        now = threads_and_fds(pid)
        if now == expected or time.monotonic() >= deadline:
            return now
        time.sleep(0.02)


def test_closed_connections_leave_no_thread_or_fd_behind(peer: NativePeer) -> None:
    idle = settled_counts(peer.pid)
    socks = [connect(peer.port) for _ in range(CONNECTIONS)]
    for sock in socks[: CONNECTIONS // 2]:
        handshake(sock, CLUSTER)  # authenticated, then idle
    for sock in socks[CONNECTIONS // 2 :]:
        send_hello(sock, CLUSTER)  # still in the handshake when it closes
    busy = counts_within(peer.pid, (idle[0], idle[1] + CONNECTIONS), 5.0)
    assert busy == (idle[0], idle[1] + CONNECTIONS)  # an fd each, no thread
    for sock in socks:
        sock.close()
    # No connection arrives after these: the server must reap on its own.
    assert counts_within(peer.pid, idle, REAP_WITHIN_S) == idle


def test_a_connection_the_server_ends_is_reaped_too(peer: NativePeer) -> None:
    """The server closes a connection whose first frame is garbage; the client keeps its
    end open, and still the server holds nothing for it."""
    idle = settled_counts(peer.pid)
    sock = connect(peer.port)
    try:
        sock.sendall(b"\x00" * 16)  # bad magic
        assert closed_by_server(sock, within_s=5.0)
        assert counts_within(peer.pid, idle, REAP_WITHIN_S) == idle
    finally:
        sock.close()
