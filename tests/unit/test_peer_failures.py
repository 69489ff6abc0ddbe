"""A prefill peer that just failed is remembered briefly: requests queued behind the failure
end at once instead of each waiting out its own handshake timeout (a dead P under load)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from registry_support import make_registry

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.peers.compatibility import PeerError
from hixl_connector.connector.peers.registry import PeerRegistry

TIMEOUT_S = 1.0
QUEUED = 10
THREADS = 2  # the transfer pool's default


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener that never answers: a handshake waits its whole timeout, as to a dead P."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield int(sock.getsockname()[1])
    sock.close()


def registry(context: zmq.Context) -> PeerRegistry:
    """D's registry; nothing ever answers its handshakes, so it never reaches the engine."""
    return make_registry(None, context, handshake_timeout_s=TIMEOUT_S)


def test_requests_queued_behind_a_dead_peer_all_end_within_one_timeout(
    silent_port: int,
) -> None:
    context = zmq.Context()
    peers = registry(context)
    target = RemoteEndpoint("prefill-dead", "127.0.0.1", silent_port, 1, 0).rank(0)

    def attempt(_: int) -> tuple[float, str]:
        try:
            peers.get(target)
        except Exception as e:  # every one must fail
            return time.monotonic(), str(e)
        return time.monotonic(), "linked"

    try:
        start = time.monotonic()
        with ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(attempt, range(QUEUED)))
        ends = [end - start for end, _ in results]
        assert all("linked" != why for _, why in results)
        # Serially each would wait TIMEOUT_S: QUEUED / THREADS * TIMEOUT_S = 5 s.
        assert max(ends) < TIMEOUT_S + 1.0, ends
        assert sum("ago" in why for _, why in results) >= QUEUED - THREADS
        # After one timeout's time the peer is tried again (it may be back).
        time.sleep(TIMEOUT_S)
        retry = time.monotonic()
        with pytest.raises(Exception, match="no reply"):
            peers.get(target)
        assert time.monotonic() - retry >= TIMEOUT_S * 0.9
        # Another engine at the same address (P restarted) is not held to the old failure.
        with pytest.raises(Exception) as info:
            peers.get(RemoteEndpoint("prefill-new", "127.0.0.1", silent_port, 1, 0).rank(0))
        assert not isinstance(info.value, PeerError) or "ago" not in str(info.value)
    finally:
        peers.close()
        context.term()
