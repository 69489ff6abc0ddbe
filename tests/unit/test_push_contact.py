"""D's first contacts with a prefill engine in push mode (push/contact.py), against
real sockets: a P that never answers is judged gone once, and every request that came
before that verdict fails with it at once instead of waiting out a timeout of its own; a
request that comes later contacts P again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from hixl_connector.connector.endpoints import PeerRank, RemoteEndpoint
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.side_channel import SideChannelClient
from hixl_connector.connector.push.contact import PeerLost, PrefillEndpoints

TIMEOUT_S = 0.5


class Clients:
    """What PrefillEndpoints asks of the peer registry: a side-channel client per rank."""

    def __init__(self, context: zmq.Context) -> None:
        self._context = context

    def client_for(self, target: PeerRank) -> SideChannelClient:
        to = Destination(target.remote.engine_id, target.rank, target.remote.incarnation)
        return SideChannelClient(self._context, target.remote.host, target.port, to, TIMEOUT_S)


@pytest.fixture
def silent_prefill() -> Iterator[tuple[zmq.Context, RemoteEndpoint]]:
    """A side channel that takes every request and answers none (a stopped P)."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield context, RemoteEndpoint("p", "127.0.0.1", port, 1, 1024)
    finally:
        sock.close(linger=0)
        context.term()


@pytest.fixture
def endpoints(
    silent_prefill: tuple[zmq.Context, RemoteEndpoint],
) -> tuple[PrefillEndpoints, RemoteEndpoint]:
    context, remote = silent_prefill
    return PrefillEndpoints(Clients(context)), remote  # type: ignore[arg-type]


def contact(endpoints: PrefillEndpoints, remote: RemoteEndpoint, since: float) -> Any:
    try:
        return endpoints.get(remote, False, since)
    except PeerLost as e:
        return e


def test_contacts_that_came_before_the_verdict_fail_with_it_at_once(
    endpoints: tuple[PrefillEndpoints, RemoteEndpoint],
) -> None:
    judged, remote = endpoints
    came = time.monotonic()
    outcomes: list[tuple[Any, float]] = []

    def one() -> None:
        outcomes.append((contact(judged, remote, came), time.monotonic() - came))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10 * TIMEOUT_S)
    assert len(outcomes) == 4
    assert all(isinstance(outcome, PeerLost) for outcome, _ in outcomes)
    # One contact waited for its timeout; the three queued behind it failed with its verdict.
    assert max(took for _, took in outcomes) < 2 * TIMEOUT_S
    assert sum("was found gone" in str(outcome) for outcome, _ in outcomes) == 3
    # A request that comes after the verdict contacts P again (and waits its own timeout).
    began = time.monotonic()
    assert isinstance(contact(judged, remote, began), PeerLost)
    assert time.monotonic() - began >= TIMEOUT_S * 0.9


def test_a_verdict_fails_only_requests_that_came_before_it(
    endpoints: tuple[PrefillEndpoints, RemoteEndpoint],
) -> None:
    judged, remote = endpoints
    before = time.monotonic()
    judged.lost(remote, "no answer to a status question")
    with pytest.raises(PeerLost, match="found gone .* after this request came"):
        judged.raise_if_lost(remote, before)
    judged.raise_if_lost(remote, time.monotonic())  # a later request: no verdict yet
    other = RemoteEndpoint("p", "127.0.0.1", remote.port + 1, 1, 1024)
    judged.raise_if_lost(other, before)  # another address is not judged
