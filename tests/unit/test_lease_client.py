"""D's lease notices over real side channels: dead addresses named by clients must not delay
the heartbeats and releases of linked prefill peers."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import zmq

from hixl_connector.connector.endpoints import PeerRank, RemoteEndpoint
from hixl_connector.connector.leases.client import LeaseClient, Outgoing, PeerLanes
from hixl_connector.connector.leases.messages import LeaseNotice
from hixl_connector.connector.metadata import ReleaseSpec, WaitingRead
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.side_channel import SideChannelClient, SideChannelServer

DEAD_TIMEOUT_S = 2.0  # each notice to a dead address waits this long for its reply
DEAD_ADDRESSES = 4


def endpoint(name: str, port: int) -> RemoteEndpoint:
    return RemoteEndpoint(name, "127.0.0.1", port, tp_size=1, cluster_id=0, incarnation=1)


def client(context: zmq.Context, target: PeerRank) -> tuple[SideChannelClient, bool]:
    """A fresh client to ``target``, owned by the caller (as for an unlinked peer)."""
    to = Destination(target.remote.engine_id, target.rank, target.remote.incarnation)
    return SideChannelClient(context, target.remote.host, target.port, to, DEAD_TIMEOUT_S), True


def test_dead_client_named_addresses_do_not_delay_linked_peers(context: zmq.Context) -> None:
    delivered: dict[str, float] = {}
    arrived = threading.Event()

    def record(message: dict[str, Any]) -> dict[str, Any]:
        delivered[message["type"]] = time.monotonic()
        if len(delivered) == 2:
            arrived.set()
        return {"results": ["ok"] * len(message["items"])}

    handlers = {"heartbeat": record, "release": record}
    server = SideChannelServer(
        context, "127.0.0.1", 0, handlers, lambda: Destination("p-live", 0, 1)
    )
    # Listening sockets that never answer: a request waits out its whole timeout.
    silent = [socket.socket() for _ in range(DEAD_ADDRESSES)]
    for sock in silent:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    live = endpoint("p-live", server.port)
    dead = [endpoint(f"dead-{i}", s.getsockname()[1]) for i, s in enumerate(silent)]
    failures: list[str] = []
    notifier = LeaseClient(
        lambda t: client(context, t),
        lambda t: t.remote.engine_id == "p-live",  # only the live peer completed a handshake
        lambda remote: {0: 1},  # equal TP: rank 0 of P, read by this rank alone
        heartbeat_s=0.01,
        rank=0,
        record=failures.append,
    )
    try:
        start = time.monotonic()
        for i, remote in enumerate(dead):  # queued first, each stalls DEAD_TIMEOUT_S
            notifier.notify("release", ReleaseSpec(f"r{i}", f"remote-r{i}", i, remote))
        beats = [WaitingRead(f"w{i}", r, f"remote-w{i}", 100 + i) for i, r in enumerate(dead)]
        waiting = [*beats, WaitingRead("live", live, "remote-live", 7)]
        notifier.waiting(waiting, [], start)  # first seen: nothing due yet
        notifier.waiting([], [], start + 0.02)  # waited past heartbeat_s: due
        notifier.notify("release", ReleaseSpec("done", "remote-done", 8, live))
        assert arrived.wait(DEAD_TIMEOUT_S * (2 * DEAD_ADDRESSES + 1))
        # Both reached the live peer while the dead addresses still held their own thread.
        assert max(delivered.values()) - start < DEAD_TIMEOUT_S, delivered
        until = time.monotonic() + 3 * DEAD_TIMEOUT_S
        while not failures and time.monotonic() < until:
            time.sleep(0.05)
        assert set(failures) == {"failed_notifications"}  # the dead ones fail, counted
    finally:
        notifier.shutdown()  # drops what is still queued for the dead addresses
        server.close()
        for sock in silent:
            sock.close()


def test_a_stalled_linked_peer_does_not_delay_another_linked_peer(context: zmq.Context) -> None:
    """Two P engines both linked; one stops answering (a stalled process). Its queued
    releases wait out their timeouts on its own lane while the other's heartbeat arrives."""
    beat = threading.Event()

    def record(message: dict[str, Any]) -> dict[str, Any]:
        beat.set()
        return {"results": [True] * len(message["items"])}

    live_rank = Destination("p-live", 0, 1)
    server = SideChannelServer(context, "127.0.0.1", 0, {"heartbeat": record}, lambda: live_rank)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen()
    live, stuck = endpoint("p-live", server.port), endpoint("p-stalled", stalled.getsockname()[1])
    notifier = LeaseClient(
        lambda t: client(context, t),
        lambda t: True,  # both completed a handshake earlier
        lambda remote: {0: 1},
        heartbeat_s=0.01,
        rank=0,
        record=lambda counter: None,
    )
    try:
        start = time.monotonic()
        for i in range(3):  # each waits out DEAD_TIMEOUT_S on the stalled peer's lane
            notifier.notify("release", ReleaseSpec(f"r{i}", f"remote-r{i}", i, stuck))
        notifier.waiting([WaitingRead("live", live, "remote-live", 7)], [], start)
        notifier.waiting([], [], start + 0.02)
        assert beat.wait(DEAD_TIMEOUT_S), "the live peer's heartbeat waited behind the stalled"
        assert time.monotonic() - start < DEAD_TIMEOUT_S / 2
    finally:
        notifier.shutdown()
        server.close()
        stalled.close()


def _outgoing(port: int, kind: str, *request_ids: str) -> Outgoing:
    items = tuple(LeaseNotice(r, 1) for r in request_ids)
    return Outgoing(endpoint("p", port).rank(0), kind, items)


def test_peer_lanes_stay_while_busy_and_end_when_idle() -> None:
    sent: list[tuple[int, str, tuple[str, ...]]] = []
    release = threading.Event()
    done = threading.Event()

    def send(target: Any, kind: str, items: tuple[LeaseNotice, ...]) -> None:
        if target.port == 1:
            release.wait(5)
        sent.append((target.port, kind, tuple(n.remote_request_id for n in items)))
        if target.port == 2:
            done.set()

    lanes = PeerLanes(send, idle_s=0.2)
    lanes.post("a", _outgoing(1, "done", "a0"))
    lanes.post("b", _outgoing(2, "done", "b0"))
    assert done.wait(5)
    assert len(lanes) == 2  # "b" waits idle_s for more before its thread ends
    until = time.monotonic() + 5
    while len(lanes) > 1 and time.monotonic() < until:
        time.sleep(0.01)
    assert len(lanes) == 1  # "b" is gone, "a" still sends
    release.set()
    while len(lanes) and time.monotonic() < until:
        time.sleep(0.01)
    assert len(lanes) == 0
    lanes.shutdown()
    lanes.post("c", _outgoing(3, "done", "c0"))  # after shutdown: dropped, no thread started
    assert len(lanes) == 0
    assert sorted(sent) == [(1, "done", ("a0",)), (2, "done", ("b0",))]


def test_peer_lanes_send_queued_notices_of_one_kind_and_peer_as_one_message() -> None:
    sent: list[tuple[int, str, tuple[str, ...]]] = []
    first = threading.Event()
    release = threading.Event()

    def send(target: Any, kind: str, items: tuple[LeaseNotice, ...]) -> None:
        first.set()
        release.wait(5)
        sent.append((target.port, kind, tuple(n.remote_request_id for n in items)))

    lanes = PeerLanes(send, idle_s=5.0)
    try:
        lanes.post("lane", _outgoing(1, "done", "r0"))
        assert first.wait(5)  # r0 is being sent; the rest queue behind it
        for notice in (
            _outgoing(1, "done", "r1"),
            _outgoing(1, "done", "r2", "r3"),
            _outgoing(1, "release", "r4"),
            _outgoing(2, "release", "r5"),
            _outgoing(1, "done", "r6"),
        ):
            lanes.post("lane", notice)
        release.set()
        until = time.monotonic() + 5
        while len(sent) < 5 and time.monotonic() < until:
            time.sleep(0.01)
    finally:
        lanes.shutdown()
    assert sent == [
        (1, "done", ("r0",)),
        (1, "done", ("r1", "r2", "r3")),  # merged: same kind, same P rank, back to back
        (1, "release", ("r4",)),
        (2, "release", ("r5",)),
        (1, "done", ("r6",)),  # order kept: nothing jumps the queue
    ]
