"""The native engine's server under resource abuse: handshake squatters, connection caps,
readers that stall or trickle, and TCP keepalive on idle links.

Real peer processes and real sockets; the server-side socket state is read from
/proc/net/tcp (the peer shares this network namespace), so no test relies on a hook
inside the engine.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hixl_connector import _native

from .native_peer import BLOCKS_CACHE_ID, CONTIGUOUS_CACHE_ID, NativePeer, pattern, start_peer
from .test_native_transfer import BLOCK_BYTES, Puller, pull_ok
from .wire_client import (
    AUTH,
    CHALLENGE,
    DATA,
    ERROR,
    HEADER,
    WELCOME,
    client_proof,
    closed_within,
    connect,
    frame,
    handshake,
    read_request,
    recv_exact,
    recv_frame,
    send_hello,
    table_serials,
    welcomed,
)

TOKEN = "server-limits-token-0123456789abcdef"
CLUSTER = 41

# The server's caps, set small here (engine options; defaults 1024 and 4096), and its
# timeouts (native/src/common/wire.h).
MAX_HANDSHAKING = 16
MAX_AUTHENTICATED = 64
HANDSHAKE_TIMEOUT_S = 5.0
SEND_STALL_S = 10.0
KEEPALIVE_IDLE_S = 30

EXTRA_SQUATTERS = 4
MARGIN_S = 1.5
PEER_BLOCKS = 256  # 1 MiB tensors: a READ of 64 of them dwarfs every socket buffer
TCP_ESTABLISHED = 1
KEEPALIVE_TIMER = 2  # /proc/net/tcp "tr" column


@dataclass(frozen=True)
class TcpRow:
    local_port: int
    remote_port: int
    state: int
    timer: int
    timer_ticks: int


def tcp_rows() -> list[TcpRow]:
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        timer, ticks = fields[5].split(":")
        rows.append(
            TcpRow(
                local_port=int(fields[1].split(":")[1], 16),
                remote_port=int(fields[2].split(":")[1], 16),
                state=int(fields[3], 16),
                timer=int(timer, 16),
                timer_ticks=int(ticks, 16),
            )
        )
    return rows


def server_side(peer: NativePeer, client: socket.socket) -> TcpRow | None:
    """The peer's end of `client`'s connection, None once the peer closed it for good."""
    port = client.getsockname()[1]
    rows = [r for r in tcp_rows() if r.local_port == peer.port and r.remote_port == port]
    return rows[0] if rows else None


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    p = start_peer(
        CLUSTER,
        token=TOKEN,
        tensors=4,
        blocks=PEER_BLOCKS,
        block_bytes=BLOCK_BYTES,
        server_handshakes=MAX_HANDSHAKING,
        server_connections=MAX_AUTHENTICATED,
    )
    yield p
    p.stop()


@pytest.fixture()
def linked(peer: NativePeer) -> Iterator[Puller]:
    puller = Puller(400, "tcp", auth_token=TOKEN)
    assert puller.engine.link(CLUSTER, "127.0.0.1", peer.port, 3000) == (0, "")
    yield puller
    puller.engine.close()


def test_handshake_squatters_cannot_starve_links(peer: NativePeer, linked: Puller) -> None:
    start = time.monotonic()
    squatters = [connect(peer.port) for _ in range(MAX_HANDSHAKING + EXTRA_SQUATTERS)]
    try:
        # The sockets beyond the handshake cap are closed at once; the rest are held.
        closed = closed_within(squatters, 1.0)
        assert closed == set(range(MAX_HANDSHAKING, len(squatters))), sorted(closed)
        # Links made before the flood keep working over their authenticated connections.
        for i in range(3):
            pull_ok(linked, CLUSTER, [i, 40 + i, 200 + i], [0, 1, 2 + i])
        # A new link is refused at once while every handshake slot is taken ...
        newcomer = Puller(401, "tcp", auth_token=TOKEN)
        try:
            t = time.monotonic()
            status, msg = newcomer.engine.link(CLUSTER, "127.0.0.1", peer.port, 3000)
            assert status == _native.LINK_BUSY, msg  # busy, not failed: try again later
            # The server's reason, naming its cap and the option that raises it.
            assert "16 connections in the handshake" in msg, msg
            assert "hixl.serverHandshakes" in msg, msg
            assert time.monotonic() - t < 1.0
            # ... and succeeds once the squatters ran into the handshake timeout.
            held = squatters[:MAX_HANDSHAKING]
            left = start + HANDSHAKE_TIMEOUT_S + MARGIN_S - time.monotonic()
            assert len(closed_within(held, left)) == MAX_HANDSHAKING
            assert newcomer.engine.link(CLUSTER, "127.0.0.1", peer.port, 3000) == (0, "")
            pull_ok(newcomer, CLUSTER, [7, 8], [9, 10])
        finally:
            newcomer.engine.close()
    finally:
        for s in squatters:
            s.close()
    # The refused extras, the timed-out squatters and the refused link attempt.
    assert peer.stats()["rejected_requests"] >= EXTRA_SQUATTERS + MAX_HANDSHAKING + 1


def test_authenticated_cap_names_its_limit(peer: NativePeer) -> None:
    # `linked` is not used: the cap is counted exactly with raw connections only.
    conns: list[socket.socket] = []
    try:
        for _ in range(MAX_AUTHENTICATED - 1):
            conns.append(welcomed(peer.port, CLUSTER, TOKEN))
        # Two handshakes pass the check on accept while one slot is left: the first to prove
        # the token takes it, the other gets an ERROR in place of WELCOME.
        first, second = connect(peer.port), connect(peer.port)
        conns += [first, second]
        nonces = [send_hello(s, CLUSTER) for s in (first, second)]
        challenges = [recv_frame(s) for s in (first, second)]
        assert [kind for kind, _ in challenges] == [CHALLENGE, CHALLENGE]
        first.sendall(frame(AUTH, client_proof(TOKEN, challenges[0][1][1:33], nonces[0])))
        assert recv_frame(first)[0] == WELCOME
        second.sendall(frame(AUTH, client_proof(TOKEN, challenges[1][1][1:33], nonces[1])))
        kind, payload = recv_frame(second)
        assert kind == ERROR and b"64 connections authenticated" in payload, payload
        assert b"hixl.serverConnections" in payload, payload
        conns.remove(second)
        second.close()
        with connect(peer.port) as extra:
            send_hello(extra, CLUSTER)
            kind, payload = recv_frame(extra)
            assert kind == ERROR
            assert b"64 connections authenticated" in payload, payload
        conns.pop().close()  # frees one slot once the server noticed the close
        deadline = time.monotonic() + 2.0
        while True:
            with connect(peer.port) as again:
                send_hello(again, CLUSTER)
                kind, _ = recv_frame(again)
                if kind == CHALLENGE:
                    break
            assert time.monotonic() < deadline, "the freed slot was never reused"
            time.sleep(0.05)
    finally:
        for s in conns:
            s.close()


def test_stalled_reader_is_dropped_and_a_slow_one_is_not(peer: NativePeer, linked: Puller) -> None:
    """...and neither holds up other caches: their unregistration, pulls from a real link."""
    base = peer.info["blocks_addrs"][0]
    tensor_bytes = peer.info["blocks_tensor_bytes"]
    request = [(base, tensor_bytes)] * 64  # 64 MiB
    stalled, slow = connect(peer.port, rcvbuf=16 << 10), connect(peer.port, rcvbuf=256 << 10)
    try:
        for sock in (stalled, slow):
            handshake(sock, CLUSTER, TOKEN)
            serial = table_serials(sock)[BLOCKS_CACHE_ID]
        start = time.monotonic()
        for sock in (stalled, slow):
            sock.sendall(read_request(serial, *request))
        _, _, kind, length = HEADER.unpack(recv_exact(slow, HEADER.size))
        assert (kind, length) == (DATA, len(request) * tensor_bytes)
        # A reader stuck on one cache holds up the unregistration of that cache only.
        unregister_start = time.monotonic()
        assert peer.command(f"drop {CONTIGUOUS_CACHE_ID}") == [0, ""]
        assert time.monotonic() - unregister_start < 1.0
        received = bytearray()
        dropped_after = None
        pulls = 0
        # The slow reader drains 256 KiB every 0.2 s: far slower than the server could send,
        # but never 10 s without progress, so only the stalled reader may be dropped.
        while time.monotonic() - start < SEND_STALL_S + MARGIN_S + 1.0:
            slow.settimeout(2.0)
            chunk = slow.recv(256 << 10)
            assert chunk, f"the slow reader was cut off after {time.monotonic() - start:.1f}s"
            received += chunk
            if dropped_after is None:
                row = server_side(peer, stalled)
                if row is None or row.state != TCP_ESTABLISHED:
                    dropped_after = time.monotonic() - start
            if pulls < 5:  # the server keeps serving a real link meanwhile
                pull_ok(linked, CLUSTER, [pulls, 100 + pulls], [3, 4])
                pulls += 1
            time.sleep(0.2)
        assert dropped_after is not None, "the stalled reader was never dropped"
        assert SEND_STALL_S - 1.0 < dropped_after < SEND_STALL_S + MARGIN_S, dropped_after
        row = server_side(peer, slow)
        assert row is not None and row.state == TCP_ESTABLISHED
        expected = pattern(CLUSTER, BLOCKS_CACHE_ID, 0, tensor_bytes).tobytes()
        assert bytes(received[: len(expected)]) == expected[: len(received)]
        assert len(received) > 1 << 20  # it kept receiving the whole time
        assert stalled_gets_less_than(stalled, len(request) * tensor_bytes)
    finally:
        stalled.close()
        slow.close()


def stalled_gets_less_than(sock: socket.socket, total: int) -> bool:
    """Drains a dropped connection: it must end (EOF or reset) before the whole reply."""
    sock.settimeout(5.0)
    got = 0
    try:
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    return got < total


def test_idle_link_sockets_have_keepalive(peer: NativePeer, linked: Puller) -> None:
    pull_ok(linked, CLUSTER, [1], [1])  # every connection of the link has been used once
    time.sleep(0.2)  # and is idle now
    hz = os.sysconf("SC_CLK_TCK")
    rows = [r for r in tcp_rows() if r.state == TCP_ESTABLISHED]
    served = [r for r in rows if r.local_port == peer.port]
    dialled = [r for r in rows if r.remote_port == peer.port]
    # The control connection and two data connections, seen from both ends.
    assert len(served) == len(dialled) == 3, (served, dialled)
    for row in served + dialled:
        assert row.timer == KEEPALIVE_TIMER, row
        assert 0 < row.timer_ticks <= KEEPALIVE_IDLE_S * hz, row
