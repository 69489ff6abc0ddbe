"""Write grants: a cache registered writes_by_grant takes a peer's writes only into blocks its
owner granted to that peer's cluster, and once revoke_writes returns nothing lands under the
grant, not even a write that was in flight when it was called (revoke waits for it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .native_peer import (
    GRANTED_CACHE_ID,
    GRANTED_MODEL_ID,
    NativePeer,
    pattern,
    start_peer,
)
from .test_native_push import BLOCK_BYTES, BLOCKS, PEER, TENSORS, Pusher
from .wire_client import (
    DATA,
    ERROR,
    WRITE,
    WRITE_DONE,
    WRITE_READY,
    connect,
    frame,
    handshake,
    recv_frame,
    table_serials,
    write_request,
)

RAW_WRITER = 900  # the cluster wire_client's HELLO names


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    p = start_peer(PEER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    yield p
    p.stop()


@pytest.fixture(params=["cma", "tcp"])
def pusher(request: pytest.FixtureRequest, peer: NativePeer) -> Iterator[Pusher]:
    client = Pusher(80, request.param)
    client.link(peer)
    assert client.engine.peer_transport(PEER) == request.param
    yield client
    client.engine.close()


def push(pusher: Pusher, src: list[int], dst: list[int]) -> tuple[int, str]:
    return pusher.push(src, dst, model_id=GRANTED_MODEL_ID)


def grant(peer: NativePeer, writer: int, blocks: list[int]) -> int:
    status, message, grant_id = peer.command(f"grant {writer} {','.join(map(str, blocks))}")
    assert status == _native.SUCCESS, message
    return int(grant_id)


def test_writes_land_only_in_granted_blocks(peer: NativePeer, pusher: Pusher) -> None:
    model = [pattern(PEER, GRANTED_CACHE_ID, t, BLOCKS * BLOCK_BYTES).reshape(BLOCKS, -1).copy()
             for t in range(TENSORS)]  # fmt: skip
    mine = [t.reshape(BLOCKS, BLOCK_BYTES) for t in pusher.src]
    status, message = push(pusher, [0], [3])
    assert status == _native.PARAM_INVALID and "not granted to cluster 80" in message
    first = grant(peer, 80, [3, 4])
    assert push(pusher, [0, 1], [3, 4]) == (0, "")
    for t in range(TENSORS):
        model[t][3], model[t][4] = mine[t][0], mine[t][1]
    # A write that reaches past the grant is refused whole: blocks 3 and 4 keep the first.
    assert push(pusher, [7, 8, 9], [3, 4, 5])[0] == _native.PARAM_INVALID
    # Granted blocks are one grant's at a time, in range, named once.
    for blocks, why in (([4, 6], "already granted"), ([BLOCKS], "outside"), ([6, 6], "twice")):
        status, message, _ = peer.command(f"grant 81 {','.join(map(str, blocks))}")
        assert status == _native.PARAM_INVALID and why in message
    assert peer.command(f"revoke {first} 1000") == [0, ""]
    assert peer.command(f"revoke {first} 1000") == [0, ""]  # already revoked
    assert push(pusher, [0], [3])[0] == _native.PARAM_INVALID
    grant(peer, 81, [3])  # another writer's now
    assert push(pusher, [0], [3])[0] == _native.PARAM_INVALID
    got = pusher.peer_blocks(GRANTED_MODEL_ID)
    for t in range(TENSORS):
        wrong = [b for b in range(BLOCKS) if not np.array_equal(got[t][b], model[t][b])]
        assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"
    assert peer.command("revoke 99999 1000")[0] == _native.PARAM_INVALID  # never issued


def test_revoke_waits_for_a_write_in_flight(peer: NativePeer) -> None:
    base = peer.info["granted_addrs"][0]
    grant_id = grant(peer, RAW_WRITER, [0])
    with connect(peer.port) as s:
        handshake(s, PEER)
        serial = table_serials(s)[GRANTED_CACHE_ID]
        s.sendall(frame(WRITE, write_request(serial, (base, 64))))
        assert recv_frame(s)[0] == WRITE_READY
        message = frame(DATA, bytes(range(64)))
        s.sendall(message[:40])  # the header and part of the bytes
        start = time.monotonic()
        status, text = peer.command(f"revoke {grant_id} 300")
        assert status == _native.TIMEOUT and "in flight" in text
        assert time.monotonic() - start >= 0.29
        # Withdrawn at once: a new write under it is refused while the first one is held.
        with connect(peer.port) as other:
            handshake(other, PEER)
            other.sendall(frame(WRITE, write_request(serial, (base + 64, 8))))
            kind, payload = recv_frame(other)
            assert kind == ERROR and b"not granted" in payload
        answers: list[object] = []
        waiting = threading.Thread(
            target=lambda: answers.append(peer.command(f"revoke {grant_id} 5000"))
        )
        waiting.start()
        time.sleep(0.3)
        assert not answers, "revoke returned while a write under the grant was in flight"
        s.sendall(message[40:])
        assert recv_frame(s) == (WRITE_DONE, b"")
        waiting.join(timeout=5)
        assert answers == [[0, ""]]


def test_only_a_remote_accessible_blocks_cache_is_written_by_grant() -> None:
    engine = _native.Engine(95)
    try:
        memory = np.zeros(4096, np.uint8)
        for is_blocks, accessible in ((False, True), (True, False)):
            status, message = engine.register_cache(
                1, [memory.ctypes.data], 4096, 4, is_blocks, accessible, -1, [],
                writes_by_grant=True,
            )  # fmt: skip
            assert status == _native.PARAM_INVALID and "written by grant" in message
        assert engine.register_cache(2, [memory.ctypes.data], 4096, 4, True, True, -1, [])[0] == 0
        status, message, _ = engine.grant_writes(7, 2, [0])
        assert status == _native.PARAM_INVALID and "not a blocks cache written by grant" in message
        assert engine.grant_writes(7, 3, [0])[0] == _native.KV_CACHE_NOT_EXIST
    finally:
        engine.close()
