"""Write grants: a cache registered writes_by_grant takes a peer's writes only into blocks of
the grant each write names, granted to that peer's cluster, and once revoke_writes returns
nothing lands under the grant, not even a write that was in flight when it was called (revoke
waits for it). A grant stands for one request: a late write naming a revoked grant misses the
grant that took its blocks over, even when that one is the same writer's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .datadist_harness import (
    BLOCK_BYTES,
    BLOCKS,
    PEER,
    TENSORS,
    Pusher,
    peer_answered,
    peer_took_command,
    serving,
)
from .native_peer import (
    GRANTED_CACHE_ID,
    GRANTED_MODEL_ID,
    MODEL_ID,
    NativePeer,
    pattern,
    start_peer,
)
from .wire_client import (
    DATA,
    ERROR,
    WRITE,
    WRITE_DONE,
    WRITE_READY,
    frame,
    recv_frame,
    table_serials,
    welcomed,
    write_request,
)

RAW_WRITER = 900  # the cluster wire_client's HELLO names


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    yield from serving(PEER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)


def push(pusher: Pusher, src: list[int], dst: list[int], grant_id: int) -> tuple[int, str]:
    return pusher.push(src, dst, model_id=GRANTED_MODEL_ID, grant=grant_id)


def grant(peer: NativePeer, writer: int, blocks: list[int]) -> int:
    status, message, grant_id = peer.command(f"grant {writer} {','.join(map(str, blocks))}")
    assert status == _native.SUCCESS, message
    return int(grant_id)


def refusal(block: int, grant_id: int, writer: int = 80) -> str:
    cache = GRANTED_CACHE_ID
    return f"block {block} of cache {cache} is not under grant {grant_id:#x} of cluster {writer}"


def initial_model() -> list[np.ndarray]:
    return [pattern(PEER, GRANTED_CACHE_ID, t, BLOCKS * BLOCK_BYTES).reshape(BLOCKS, -1).copy()
            for t in range(TENSORS)]  # fmt: skip


def assert_model(pusher: Pusher, model: list[np.ndarray]) -> None:
    got = pusher.peer_blocks(GRANTED_MODEL_ID)
    for t in range(TENSORS):
        wrong = [b for b in range(BLOCKS) if not np.array_equal(got[t][b], model[t][b])]
        assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"


def landed(model: list[np.ndarray], pusher: Pusher, src: list[int], dst: list[int]) -> None:
    mine = [t.reshape(BLOCKS, BLOCK_BYTES) for t in pusher.src]
    for t in range(TENSORS):
        for s, d in zip(src, dst, strict=True):
            model[t][d] = mine[t][s]


def test_writes_land_only_in_granted_blocks(peer: NativePeer, pusher: Pusher) -> None:
    model = initial_model()
    status, message = push(pusher, [0], [3], 0)
    assert status == _native.PARAM_INVALID and refusal(3, 0) in message, message
    first = grant(peer, 80, [3, 4])
    assert push(pusher, [0, 1], [3, 4], first) == (0, "")
    landed(model, pusher, [0, 1], [3, 4])
    # A write that reaches past the grant is refused whole: blocks 3 and 4 keep the first.
    status, message = push(pusher, [7, 8, 9], [3, 4, 5], first)
    assert status == _native.PARAM_INVALID and refusal(5, first) in message, message
    # Granted blocks are one grant's at a time, in range, named once.
    for blocks, why in (([4, 6], "already granted"), ([BLOCKS], "outside"), ([6, 6], "twice")):
        status, message, _ = peer.command(f"grant 81 {','.join(map(str, blocks))}")
        assert status == _native.PARAM_INVALID and why in message
    assert peer.command(f"revoke {first} 1000") == [0, ""]
    assert peer.command(f"revoke {first} 1000") == [0, ""]  # already revoked
    assert push(pusher, [0], [3], first)[0] == _native.PARAM_INVALID
    other = grant(peer, 81, [3])  # another writer's now
    assert push(pusher, [0], [3], first)[0] == _native.PARAM_INVALID
    status, message = push(pusher, [0], [3], other)  # naming it does not make it ours
    assert status == _native.PARAM_INVALID and refusal(3, other) in message, message
    assert_model(pusher, model)
    never = other + 1000
    assert peer.command(f"revoke {never} 1000")[0] == _native.PARAM_INVALID  # never issued
    # A cache not written by grant ignores the field, whatever it names.
    assert pusher.push([0], [1], model_id=MODEL_ID, grant=never) == (0, "")


def test_a_write_lands_only_under_the_grant_it_names(peer: NativePeer, pusher: Pusher) -> None:
    model = initial_model()
    a = grant(peer, 80, [3, 4])
    b = grant(peer, 80, [5, 6])  # the same writer's, another request
    for src, dst, named, bad in (
        ([0], [3], 0, 3),  # no grant named
        ([0], [3], b, 3),  # the writer's other grant
        ([0], [5], a, 5),
        ([0, 1], [4, 5], a, 5),  # partly under the grant it names: refused whole
    ):
        status, message = push(pusher, src, dst, named)
        assert status == _native.PARAM_INVALID and refusal(bad, named) in message, message
    assert_model(pusher, model)
    assert push(pusher, [0, 1], [3, 4], a) == (0, "")
    assert push(pusher, [2, 3], [5, 6], b) == (0, "")
    landed(model, pusher, [0, 1, 2, 3], [3, 4, 5, 6])
    assert_model(pusher, model)


def test_a_late_write_for_a_revoked_grant_misses_the_next_one(
    peer: NativePeer, pusher: Pusher
) -> None:
    """D grants blocks to P for request A, times out and revokes A, then grants the same
    blocks to the same P for request B: P's late push for A must not land in B's blocks."""
    model = initial_model()
    a = grant(peer, 80, [3, 4])
    assert push(pusher, [0, 1], [3, 4], a) == (0, "")
    landed(model, pusher, [0, 1], [3, 4])
    assert peer.command(f"revoke {a} 1000") == [0, ""]
    b = grant(peer, 80, [3, 4])
    assert b != a
    status, message = push(pusher, [7, 8], [3, 4], a)
    assert status == _native.PARAM_INVALID and refusal(3, a) in message, message
    assert_model(pusher, model)  # B's blocks are as A's write left them
    assert push(pusher, [9, 10], [3, 4], b) == (0, "")
    landed(model, pusher, [9, 10], [3, 4])
    assert_model(pusher, model)


def test_revoke_waits_for_a_write_in_flight(peer: NativePeer) -> None:
    base = peer.info["granted_addrs"][0]
    grant_id = grant(peer, RAW_WRITER, [0])
    with welcomed(peer.port, PEER) as s:
        serial = table_serials(s)[GRANTED_CACHE_ID]
        s.sendall(frame(WRITE, write_request(serial, (base, 8))))  # naming no grant
        kind, payload = recv_frame(s)
        assert kind == ERROR and refusal(0, 0, RAW_WRITER).encode() in payload
        s.sendall(frame(WRITE, write_request(serial, (base, 64), grant=grant_id)))
        assert recv_frame(s)[0] == WRITE_READY
        message = frame(DATA, bytes(range(64)))
        s.sendall(message[:40])  # the header and part of the bytes
        start = time.monotonic()
        status, text = peer.command(f"revoke {grant_id} 300")
        assert status == _native.TIMEOUT and "in flight" in text
        assert time.monotonic() - start >= 0.29
        # Withdrawn at once: a new write under it is refused while the first one is held.
        with welcomed(peer.port, PEER) as other:
            other.sendall(frame(WRITE, write_request(serial, (base + 64, 8), grant=grant_id)))
            kind, payload = recv_frame(other)
            assert kind == ERROR and refusal(0, grant_id, RAW_WRITER).encode() in payload
        answers: list[tuple[object, float]] = []
        waiting = threading.Thread(
            target=lambda: answers.append(
                (peer.command(f"revoke {grant_id} 5000"), time.monotonic())
            )
        )
        waiting.start()
        peer_took_command(peer)  # the peer is in the revoke (or already answered it)
        unanswered = not answers and not peer_answered(peer)
        assert unanswered, "revoke returned while a write under the grant was in flight"
        released = time.monotonic()
        s.sendall(message[40:])
        assert recv_frame(s) == (WRITE_DONE, b"")
        waiting.join(timeout=5)
        assert [answer for answer, _ in answers] == [[0, ""]]
        assert answers[0][1] >= released, "revoke returned before the write in flight ended"


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


def test_grant_ids_start_at_random_and_count_up() -> None:
    """A restarted engine must not reissue an id a writer may still hold: each engine's first
    id is random (never 0 or 1, always an int64 > 0), and its later ones count up."""
    memory = np.zeros(4096, np.uint8)
    firsts = []
    for cluster in (96, 97):
        engine = _native.Engine(cluster)
        try:
            status, message = engine.register_cache(
                1, [memory.ctypes.data], 4096, 4, True, True, -1, [], writes_by_grant=True
            )
            assert status == _native.SUCCESS, message
            ids = [engine.grant_writes(7, 1, [b]) for b in (0, 1)]
            assert [status for status, _, _ in ids] == [0, 0], ids
            first, second = (grant_id for _, _, grant_id in ids)
            assert 1 < first < 2**63 and second == first + 1
            firsts.append(first)
        finally:
            engine.close()
    assert firsts[0] != firsts[1]


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_revoke_under_many_threads_leaves_nothing_landing_after_it(transport: str) -> None:
    """A grant revoked while a large write spreads over every transfer thread of the
    destination (cma: its pool copies in from the writer; tcp: every connection receives): the
    revoke finds the write in flight and returns only once every thread is done, so bytes the
    writer changes afterwards never land, and no byte lands outside the granted blocks."""
    threads, blocks, block_bytes = 8, 64, 256 * 1024
    granted = list(range(8, 56))
    d = start_peer(PEER, tensors=TENSORS, blocks=blocks, block_bytes=block_bytes,
                   transfer_threads=threads, server_threads=threads)  # fmt: skip
    writer = _native.Engine(80, transport=transport, transfer_threads=threads,
                            tcp_connections=threads)  # fmt: skip
    nbytes = blocks * block_bytes
    before = [pattern(1, 0, t, nbytes) for t in range(TENSORS)]
    after = [pattern(2, 0, t, nbytes) for t in range(TENSORS)]
    src = [b.copy() for b in before]
    back = [np.zeros(nbytes, np.uint8) for _ in range(TENSORS)]
    stop = threading.Event()
    try:
        for cache_id, tensors in ((1, src), (2, back)):
            addrs = [t.ctypes.data for t in tensors]
            assert (
                writer.register_cache(cache_id, addrs, nbytes, blocks, True, True, -1, [])[0] == 0
            )
        assert writer.link(PEER, "127.0.0.1", d.port, 3000) == (0, "")
        in_flight_seen = False
        for _ in range(20):  # until a revoke lands while a write is in flight
            grant_id = grant(d, 80, granted)
            pushed: list[tuple[int, str]] = []

            def push_until_refused(grant_id: int = grant_id, pushed: list = pushed) -> None:
                while not stop.is_set():
                    result = writer.push(PEER, GRANTED_MODEL_ID, 1, granted, granted, 0, -1, 0,
                                         -1, 10_000, grant=grant_id)  # fmt: skip
                    pushed.append(result)
                    if result[0] != 0:
                        return

            pushing = threading.Thread(target=push_until_refused)
            pushing.start()
            while not pushed and pushing.is_alive():
                time.sleep(0.001)
            status, message = d.command(f"revoke {grant_id} 1")
            assert status in (_native.SUCCESS, _native.TIMEOUT), message
            in_flight_seen = status == _native.TIMEOUT
            if in_flight_seen:
                assert d.command(f"revoke {grant_id} 10000") == [0, ""]
                for s, a in zip(src, after, strict=True):
                    s[:] = a  # the writer's bytes change the moment the revoke returned
            pushing.join(timeout=30)
            assert not pushing.is_alive()
            assert pushed[-1][0] == _native.PARAM_INVALID, pushed[-1]
            if in_flight_seen:
                break
        assert in_flight_seen, "no revoke found a write in flight in 20 tries"
        time.sleep(0.2)
        ids = list(range(blocks))
        assert writer.pull(PEER, 0, GRANTED_MODEL_ID, -1, -1, -1, 0, 2, ids, ids, 0, -1, 0, -1,
                           10_000) == (0, "")  # fmt: skip
        for t in range(TENSORS):
            got = back[t].reshape(blocks, block_bytes)
            initial = pattern(PEER, GRANTED_CACHE_ID, t, nbytes).reshape(blocks, block_bytes)
            written = before[t].reshape(blocks, block_bytes)
            for b in range(blocks):
                expected = written[b] if b in granted else initial[b]
                assert np.array_equal(got[b], expected), f"tensor {t} block {b}"
    finally:
        stop.set()
        writer.close()
        d.stop()
