"""Native engine pushes (writes into a peer's blocks cache) under changes and faults, and the
destination's server against hostile WRITE requests: a write lands only in a remote-accessible
registration it pins, only inside its tensors, and a writer that stalls is dropped."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from hixl_connector import _native

from .datadist_harness import (
    BACK_CACHE,
    BLOCK_BYTES,
    BLOCKS,
    PEER,
    TENSORS,
    TIMEOUT_MS,
    Pusher,
    peer_answered,
    peer_took_command,
    serving,
)
from .native_peer import (
    BLOCKS_CACHE_ID,
    CONTIGUOUS_CACHE_ID,
    NativePeer,
    pattern,
    stopped,
)
from .wire_client import (
    DATA,
    ERROR,
    FROM_WRITER,
    STALE,
    TABLE,
    TABLE_REQ,
    WRITE,
    WRITE_DONE,
    WRITE_READY,
    closed_by_server,
    frame,
    recv_frame,
    table_serials,
    welcomed,
    write_request,
)

MARGIN_S = 0.3
STALL_S = 10.0  # wire::kSendStallTimeoutMs


def original(tensor: int) -> np.ndarray:
    return pattern(PEER, BLOCKS_CACHE_ID, tensor, BLOCKS * BLOCK_BYTES).reshape(BLOCKS, -1)


def assert_untouched(pusher: Pusher) -> None:
    for t, got in enumerate(pusher.peer_blocks()):
        assert np.array_equal(got, original(t)), f"tensor {t} of the peer changed"


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    yield from serving(PEER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)


def test_push_lands_and_the_peer_counts_it(peer: NativePeer, pusher: Pusher) -> None:
    assert pusher.push([5, 6, 7, 60], [10, 11, 12, 0]) == (0, "")
    mine = [t.reshape(BLOCKS, -1) for t in pusher.src]
    for t, got in enumerate(pusher.peer_blocks()):
        want = original(t).copy()
        want[[10, 11, 12, 0]] = mine[t][[5, 6, 7, 60]]
        assert np.array_equal(got, want), t
    stats = peer.stats()
    assert stats["received_writes"] >= 1
    assert stats["received_bytes"] == 4 * TENSORS * BLOCK_BYTES


def test_push_to_an_unregistered_cache_is_refused_and_the_link_stays_up(
    peer: NativePeer, pusher: Pusher
) -> None:
    assert pusher.push([1], [1]) == (0, "")
    assert peer.command("drop") == "ok"
    status, msg = pusher.push([2], [2])
    assert status == _native.KV_CACHE_NOT_EXIST, msg
    # The link still serves the peer's other cache.
    status, msg = pusher.engine.pull(PEER, 1, -1, CONTIGUOUS_CACHE_ID, -1, -1, 0, BACK_CACHE,
                                     [], [0], 0, -1, 0, -1, TIMEOUT_MS)  # fmt: skip
    assert status == _native.SUCCESS, msg


def test_stopped_peer_times_out_the_push_then_relinks(peer: NativePeer, pusher: Pusher) -> None:
    with stopped(peer.pid):
        start = time.monotonic()
        status, msg = pusher.push([0], [0], timeout_ms=400)
        assert status == _native.TIMEOUT, msg
        assert time.monotonic() - start < 0.4 + MARGIN_S
        status, msg = pusher.push([0], [0])
        assert status == _native.NOT_YET_LINK and "broken" in msg
    assert pusher.engine.unlink(PEER, 1000, True) == (0, "")
    pusher.link(peer)
    assert pusher.push([3], [4]) == (0, "")


def _serials(peer: NativePeer) -> dict[int, int]:
    with welcomed(peer.port, PEER) as s:
        return table_serials(s)


@contextmanager
def accepted_write(peer: NativePeer, length: int) -> Iterator[socket.socket]:
    """A raw writer's connection whose WRITE of ``length`` bytes at the start of the peer's
    blocks cache the peer accepted (WRITE_READY): what the test sends next is the write's DATA."""
    serial, base = _serials(peer)[BLOCKS_CACHE_ID], peer.info["blocks_addrs"][0]
    with welcomed(peer.port, PEER) as s:
        s.sendall(frame(WRITE, write_request(serial, (base, length))))
        assert recv_frame(s)[0] == WRITE_READY
        yield s


def test_hostile_writes_are_refused_and_nothing_lands(peer: NativePeer) -> None:
    serials = _serials(peer)
    base, tensor_bytes = peer.info["blocks_addrs"][0], peer.info["blocks_tensor_bytes"]
    blocks = serials[BLOCKS_CACHE_ID]
    with welcomed(
        peer.port, PEER
    ) as s:  # Past the end of a tensor: refused, and the connection stays in step.
        s.sendall(frame(WRITE, write_request(blocks, (base + tensor_bytes - 8, 16))))
        kind, payload = recv_frame(s)
        assert kind == ERROR and b"outside the tensors" in payload
        # A cache that is not remote-accessible is not writable, even under its serial (the
        # one after the table's: it was registered last).
        private = max(serials.values()) + 1
        s.sendall(frame(WRITE, write_request(private, (peer.info["private_addr"], 8))))
        assert recv_frame(s)[0] == STALE
        # A same-host writer whose proof does not read back is refused.
        proof = struct.pack("<QqQ", base, os.getpid(), base) + bytes(16)
        s.sendall(frame(WRITE, write_request(blocks, (base, 8), source=FROM_WRITER) + proof))
        kind, payload = recv_frame(s)
        assert kind == ERROR and b"cannot copy from the writer" in payload
        s.sendall(frame(TABLE_REQ))
        assert recv_frame(s)[0] == TABLE
    # After WRITE_READY only the write's DATA frame may come, of exactly its length.
    for wrong in (frame(TABLE_REQ), frame(DATA, bytes(9))):
        with accepted_write(peer, 8) as s:
            s.sendall(wrong)
            kind, _ = recv_frame(s)
            assert kind == ERROR
            assert closed_by_server(s, 2.0)
    pusher = Pusher(81, "tcp")
    try:
        pusher.link(peer)
        assert_untouched(pusher)
    finally:
        pusher.engine.close()


def test_a_stalled_writer_is_dropped_and_unregistration_waits_for_it(peer: NativePeer) -> None:
    with accepted_write(peer, 4096) as s:
        s.sendall(frame(DATA, bytes(4096))[:1016])  # the header and part of the bytes
        answers: list[tuple[object, float]] = []
        start = time.monotonic()
        dropping = threading.Thread(
            target=lambda: answers.append((peer.command("drop 1"), time.monotonic()))
        )
        dropping.start()
        peer_took_command(peer)  # the peer is in the unregistration (or already answered it)
        unanswered = not answers and not peer_answered(peer)
        assert unanswered, "unregistration finished while a write held the cache"
        assert closed_by_server(s, STALL_S + 3)
        dropped_at = time.monotonic()
        dropping.join(timeout=5)
        assert [answer for answer, _ in answers] == [[0, ""]]
        assert STALL_S - 1 < dropped_at - start < STALL_S + 3
        answered_after = answers[0][1] - start
        assert answered_after > STALL_S - 1, "unregistration did not wait for the stalled write"
    assert peer.stats()["received_writes"] == 0


def test_write_done_only_after_every_byte(peer: NativePeer) -> None:
    with accepted_write(peer, 64) as s:
        message = frame(DATA, bytes(range(64)))
        s.sendall(message[:40])
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(1)
        s.settimeout(5)
        s.sendall(message[40:])
        assert recv_frame(s) == (WRITE_DONE, b"")
    pusher = Pusher(82, "tcp")
    try:
        pusher.link(peer)
        got = pusher.peer_blocks()[0][0]
        assert bytes(got[:64]) == bytes(range(64))
        assert np.array_equal(got[64:], original(0)[0][64:])
    finally:
        pusher.engine.close()
