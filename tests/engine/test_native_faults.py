"""Native engine under faults: stopped and killed peers, hostile clients, authentication."""

from __future__ import annotations

import signal
import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .native_peer import (
    BLOCKS_CACHE_ID,
    NativePeer,
    pattern,
    start_peer,
    stopped,
)
from .test_native_transfer import BLOCK_BYTES, BLOCKS, Puller, pull_ok
from .wire_client import (
    CONTROL_CHANNEL,
    DATA,
    ERROR,
    HEADER,
    HELLO,
    MAGIC,
    READ,
    RETURN_PATH,
    RETURN_PATH_ACK,
    STALE,
    TABLE_REQ,
    VERSION,
    closed_by_server,
    connect,
    frame,
    handshake,
    read_request,
    recv_frame,
    table_serials,
    welcomed,
)

MARGIN_S = 0.2
TOKEN = "native-faults-token-0123456789abcdef"
# As long as a real token, so the refusal comes from the HMAC check, not the length rule.
WRONG_TOKEN = "native-faults-wrong-token-0123456789abcdef"


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    p = start_peer(21, tensors=4, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    yield p
    p.stop()


@pytest.fixture()
def token_peer() -> Iterator[NativePeer]:
    p = start_peer(22, token=TOKEN, tensors=4, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    yield p
    p.stop()


def test_stopped_peer_times_out_then_relinks() -> None:
    big = start_peer(23, tensors=4, blocks=64, block_bytes=256 << 10)
    puller = Puller(200, "tcp", block_bytes=256 << 10)
    try:
        assert puller.engine.link(23, "127.0.0.1", big.port, 3000) == (0, "")
        with stopped(big.pid):
            start = time.monotonic()
            status, msg = puller.pull_blocks([0], [0], cluster=23, timeout_ms=400)
            elapsed = time.monotonic() - start
            assert status == _native.TIMEOUT, msg
            assert elapsed < 0.4 + MARGIN_S, elapsed
            status, msg = puller.pull_blocks([0], [0], cluster=23)
            assert status == _native.NOT_YET_LINK and "broken" in msg
        assert puller.engine.unlink(23, 1000, True) == (0, "")
        assert puller.engine.link(23, "127.0.0.1", big.port, 3000) == (0, "")
        assert puller.pull_blocks([0, 1], [5, 6], cluster=23) == (0, "")
        assert puller.engine.stats()["timeouts"] == 1
    finally:
        puller.engine.close()
        big.stop()


def test_unlink_during_pull_fails_it_fast(peer: NativePeer) -> None:
    puller = Puller(201, "tcp")
    try:
        assert puller.engine.link(21, "127.0.0.1", peer.port, 3000) == (0, "")
        with stopped(peer.pid):
            status, handle, _ = puller.pull_blocks(
                [0], [0], cluster=21, timeout_ms=5000, submit=True
            )
            assert status == _native.SUCCESS
            time.sleep(0.1)
            start = time.monotonic()
            assert puller.engine.unlink(21, 2000, True) == (0, "")
            status, msg = puller.engine.wait(handle, 2000)
            assert status in (_native.LINK_BUSY, _native.FAILED), msg
            assert time.monotonic() - start < 1.0
    finally:
        puller.engine.close()


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_killed_peer_fails_bounded_and_others_keep_working(
    peer: NativePeer, transport: str
) -> None:
    victim = start_peer(24, tensors=4, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    puller = Puller(202, transport)
    try:
        assert puller.engine.link(24, "127.0.0.1", victim.port, 3000) == (0, "")
        assert puller.engine.link(21, "127.0.0.1", peer.port, 3000) == (0, "")
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=10)
        start = time.monotonic()
        status, msg = puller.pull_blocks([1, 2], [1, 2], cluster=24, timeout_ms=2000)
        assert status == _native.FAILED, msg
        assert time.monotonic() - start < 2.0 + MARGIN_S
        pull_ok(puller, 21, [9, 3, 4], [0, 1, 2])
        assert puller.engine.unlink(24, 500, True) == (0, "")
        pull_ok(puller, 21, [5], [63])
    finally:
        puller.engine.close()
        victim.stop()


def test_hostile_clients_are_refused_and_server_keeps_serving(peer: NativePeer) -> None:
    # Random bytes: bad magic -> closed at once.
    with connect(peer.port) as s:
        s.sendall(np.random.default_rng(1).bytes(300))
        assert closed_by_server(s, 2.0)
    # Oversized length in a well-formed header.
    with connect(peer.port) as s:
        s.sendall(HEADER.pack(MAGIC, VERSION, HELLO, 1 << 40))
        assert closed_by_server(s, 2.0)
    # Truncated frame: the rest never comes; the server gives up after its frame timeout.
    with connect(peer.port) as s:
        s.sendall(frame(HELLO, b"\x00" * 49)[:30])
        assert closed_by_server(s, 8.0)
    # Requests before the handshake.
    with connect(peer.port) as s:
        s.sendall(read_request(1, (peer.info["blocks_addrs"][0], 64)))
        assert closed_by_server(s, 2.0)
    # Authenticated (no token needed) but asking for memory outside the registered regions.
    base = peer.info["blocks_addrs"][0]
    size = peer.info["blocks_tensor_bytes"]
    with welcomed(peer.port, 21) as s:
        serial = table_serials(s)[BLOCKS_CACHE_ID]
        s.sendall(read_request(serial + 1000, (base, 64)))  # planned from another table
        assert recv_frame(s) == (STALE, b"")
        for bad in [
            (peer.info["private_addr"], 64),
            (base + size - 8, 16),
            (16, 8),
            (2**64 - 8, 16),
            (base - 1, 2),
        ]:
            s.sendall(read_request(serial, (base, 64), bad))
            kind, payload = recv_frame(s)
            assert kind == ERROR, bad
            assert b"outside" in payload
        s.sendall(read_request(serial, (base + BLOCK_BYTES, 128)))
        kind, payload = recv_frame(s)
        assert kind == DATA  # the data follows the header like a payload
        expected = pattern(21, BLOCKS_CACHE_ID, 0, 2 * BLOCK_BYTES)[BLOCK_BYTES:]
        assert payload == expected[:128].tobytes()
        s.sendall(frame(READ, struct.pack("<QI", serial, 5)))  # count disagrees with length
        kind, _ = recv_frame(s)
        assert kind == ERROR
        assert closed_by_server(s, 2.0)
    with welcomed(peer.port, 21) as s:
        s.sendall(frame(99))  # unknown frame type
        assert closed_by_server(s, 2.0)
    assert peer.stats()["rejected_requests"] >= 9
    puller = Puller(203, "tcp")
    try:
        assert puller.engine.link(21, "127.0.0.1", peer.port, 3000) == (0, "")
        pull_ok(puller, 21, [7, 8, 2], [1, 2, 60])
    finally:
        puller.engine.close()


def return_path(host: bytes, port: int) -> bytes:
    return frame(RETURN_PATH, struct.pack("<I", len(host)) + host + struct.pack("<I", port))


def test_return_path_offers_are_checked(peer: NativePeer) -> None:
    """Only a control connection offers a way back, and only a well-formed one is kept."""
    with welcomed(peer.port, 21, channel=CONTROL_CHANNEL) as s:
        s.sendall(return_path(b"", 4242))
        assert recv_frame(s) == (RETURN_PATH_ACK, b"")
        s.sendall(return_path(b"127.0.0.1", 4243))  # a later offer replaces it
        assert recv_frame(s) == (RETURN_PATH_ACK, b"")
    before = peer.stats()["rejected_requests"]
    for bad in [
        return_path(b"", 0),
        return_path(b"", 70000),
        return_path(b"h" * 300, 4242),
        frame(RETURN_PATH, struct.pack("<I", 0) + b"\x92\x10"),  # port cut short
        frame(RETURN_PATH, struct.pack("<I", 0) + struct.pack("<I", 4242) + b"x"),
    ]:
        with welcomed(peer.port, 21, channel=CONTROL_CHANNEL) as s:
            s.sendall(bad)
            kind, _ = recv_frame(s)
            assert kind == ERROR
            assert closed_by_server(s, 2.0)
    with welcomed(peer.port, 21) as s:  # a data connection
        s.sendall(return_path(b"", 4242))
        kind, _ = recv_frame(s)
        assert kind == ERROR
        assert closed_by_server(s, 2.0)
    assert peer.stats()["rejected_requests"] == before + 6


def test_token_peer_refuses_unauthenticated_clients(token_peer: NativePeer) -> None:
    base = token_peer.info["blocks_addrs"][0]
    with connect(token_peer.port) as s:
        s.sendall(frame(TABLE_REQ))
        assert closed_by_server(s, 2.0)
    with connect(token_peer.port) as s:
        with pytest.raises(AssertionError):
            handshake(s, 22, token="")  # zero proof
    with connect(token_peer.port) as s:
        with pytest.raises(AssertionError):
            handshake(s, 22, token=WRONG_TOKEN)
    with welcomed(token_peer.port, 22, token=TOKEN) as s:
        s.sendall(read_request(table_serials(s)[BLOCKS_CACHE_ID], (base, 256)))
        kind, payload = recv_frame(s)
        assert kind == DATA
        assert payload == pattern(22, BLOCKS_CACHE_ID, 0, 256).tobytes()
    assert token_peer.stats()["rejected_requests"] >= 3


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_auth_on(token_peer: NativePeer, transport: str) -> None:
    for token, ok in [(TOKEN, True), (WRONG_TOKEN, False), ("", False)]:
        puller = Puller(204, transport, auth_token=token)
        try:
            status, msg = puller.engine.link(22, "127.0.0.1", token_peer.port, 3000)
            if ok:
                assert status == _native.SUCCESS, msg
                pull_ok(puller, 22, [3, 4], [0, 9])
            else:
                assert status == _native.LINK_FAILED and "authentication failed" in msg, msg
                assert puller.engine.peer_transport(22) == ""
        finally:
            puller.engine.close()


def test_auth_off_and_token_client_to_tokenless_peer(peer: NativePeer) -> None:
    plain = Puller(205, "auto")
    with_token = Puller(206, "auto", auth_token=TOKEN)
    try:
        assert plain.engine.link(21, "127.0.0.1", peer.port, 3000) == (0, "")
        pull_ok(plain, 21, [1], [2])
        status, msg = with_token.engine.link(21, "127.0.0.1", peer.port, 3000)
        assert status == _native.LINK_FAILED and "authentication failed" in msg
    finally:
        plain.engine.close()
        with_token.engine.close()


def test_link_to_dead_port_is_bounded() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    puller = Puller(207, "auto")
    try:
        start = time.monotonic()
        status, msg = puller.engine.link(30, "127.0.0.1", port, 1000)
        assert status == _native.LINK_FAILED and str(port) in msg
        assert time.monotonic() - start < 1.0 + MARGIN_S
    finally:
        puller.engine.close()
