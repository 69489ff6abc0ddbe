"""Pulls while the peer unregisters and registers caches, over cma and tcp.

A link plans from the peer's registrations as of link time; as with LLM-DataDist, memory the
peer registers later is not remotely accessible until the next link. These tests change the
real table in the peer process and check that a pull never reads through a registration the
peer has since removed, even when the removal races the read: it returns the bytes of the
registration it planned from, whole, or fails with KV_CACHE_NOT_EXIST, and the link stays up.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .native_peer import (
    BLOCKS_CACHE_ID,
    EXTRA_MODEL_ID,
    MODEL_ID,
    NativePeer,
    pattern,
    start_peer,
)
from .test_native_transfer import BLOCK_BYTES, BLOCKS, PEER_CLUSTER, TENSORS, TIMEOUT_MS

TRANSPORTS = ["cma", "tcp"]
DST_CACHE = 60
# Large blocks make each read long enough for an unregistration to land inside it.
RACE_BLOCKS, RACE_BLOCK_BYTES = 32, 64 << 10
RACE_ROUNDS = 12


class BlocksPuller:
    """A client engine with two blocks caches shaped like the peer's (so the result of one
    pull survives the next), pulling the peer's blocks in reverse order."""

    def __init__(self, cluster_id: int, transport: str, blocks: int, block_bytes: int) -> None:
        self.blocks, self.block_bytes = blocks, block_bytes
        self.engine = _native.Engine(cluster_id, transport=transport)
        self.buffers = [
            [np.zeros(blocks * block_bytes, np.uint8) for _ in range(TENSORS)] for _ in range(2)
        ]
        for cache_id, tensors in enumerate(self.buffers, DST_CACHE):
            addrs = [t.ctypes.data for t in tensors]
            status, message = self.engine.register_cache(
                cache_id, addrs, blocks * block_bytes, blocks, True, True, -1, []
            )
            assert status == _native.SUCCESS, message

    def link(self, peer: NativePeer) -> None:
        assert self.engine.link(PEER_CLUSTER, "127.0.0.1", peer.port, 3000) == (0, "")

    def relink(self, peer: NativePeer) -> None:
        assert self.engine.unlink(PEER_CLUSTER, 1000, False) == (0, "")
        self.link(peer)

    def pull(
        self, model_id: int = MODEL_ID, count: int | None = None, buffer: int = 0
    ) -> tuple[int, str]:
        ids = list(range(count or self.blocks))
        return self.engine.pull(PEER_CLUSTER, 0, model_id, -1, -1, -1, 0, DST_CACHE + buffer,
                                ids[::-1], ids, 0, -1, 0, -1, TIMEOUT_MS)  # fmt: skip

    def untouched(self, buffer: int = 0) -> bool:
        return all(not t.any() for t in self.buffers[buffer])

    def source_tag(
        self, count: int | None = None, source_blocks: int | None = None, buffer: int = 0
    ) -> int:
        """The tag of the one registration every pulled byte came from, whole."""
        count = count or self.blocks
        dst = self.buffers[buffer]
        tag = int(dst[0].view(np.uint64)[0] >> np.uint64(48)) & 0xFF
        for t, data in enumerate(dst):
            nbytes = (source_blocks or self.blocks) * self.block_bytes
            source = pattern(PEER_CLUSTER, tag, t, nbytes).reshape(-1, self.block_bytes)
            got = data.reshape(self.blocks, -1)[:count]
            assert np.array_equal(got, source[:count][::-1]), f"tensor {t} is not one registration"
        return tag

    def close(self) -> None:
        self.engine.close()


@pytest.fixture()
def peer() -> Iterator[NativePeer]:
    p = start_peer(PEER_CLUSTER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    yield p
    p.stop()


@pytest.fixture(params=TRANSPORTS)
def puller(request: pytest.FixtureRequest, peer: NativePeer) -> Iterator[BlocksPuller]:
    client = BlocksPuller(300, request.param, BLOCKS, BLOCK_BYTES)
    client.link(peer)
    assert client.engine.peer_transport(PEER_CLUSTER) == request.param
    yield client
    client.close()


def test_unregistered_source_is_refused_and_the_link_stays_up(
    peer: NativePeer, puller: BlocksPuller
) -> None:
    assert puller.pull() == (0, "")
    assert puller.source_tag() == BLOCKS_CACHE_ID
    assert peer.command("drop") == "ok"
    status, message = puller.pull(buffer=1)
    assert status == _native.KV_CACHE_NOT_EXIST, message
    assert puller.untouched(buffer=1)  # the second buffer got nothing
    assert puller.engine.stats()["failures"] == 1
    puller.relink(peer)  # a clean unlink: the link was not broken


def test_re_registration_is_pullable_after_relink(peer: NativePeer, puller: BlocksPuller) -> None:
    assert peer.command("swap 10") == "ok"
    status, message = puller.pull()
    assert status == _native.KV_CACHE_NOT_EXIST, message  # registered after the link
    puller.relink(peer)
    assert puller.pull() == (0, "")
    assert puller.source_tag() == 10


def test_cache_registered_after_link_is_not_remotely_accessible(
    peer: NativePeer, puller: BlocksPuller
) -> None:
    assert peer.command("add") == "ok"
    status, message = puller.pull(model_id=EXTRA_MODEL_ID, count=4)
    assert status == _native.KV_CACHE_NOT_EXIST, message
    assert puller.pull() == (0, "")  # caches registered before the link still are
    puller.relink(peer)
    assert puller.pull(model_id=EXTRA_MODEL_ID, count=4) == (0, "")
    assert puller.source_tag(count=4, source_blocks=4) == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pulls_racing_unregistration_never_mix_or_break(transport: str) -> None:
    peer = start_peer(PEER_CLUSTER, tensors=TENSORS, blocks=RACE_BLOCKS,
                      block_bytes=RACE_BLOCK_BYTES)  # fmt: skip
    puller = BlocksPuller(301, transport, RACE_BLOCKS, RACE_BLOCK_BYTES)
    rng = random.Random(7)
    try:
        puller.link(peer)
        expected_tag = BLOCKS_CACHE_ID
        for round_ in range(RACE_ROUNDS):
            new_tag = 10 + round_
            # After a first good pull, the peer unregisters the source (and scribbles over
            # it) while pulls run back to back, alternating buffers; the last good one is
            # checked whole.
            swap = threading.Timer(
                rng.uniform(0, 0.003), lambda tag=new_tag: peer.command(f"swap {tag}")
            )
            deadline = time.monotonic() + 10
            last_good = None
            for pull_index in itertools.count():
                buffer = pull_index % 2
                status, message = puller.pull(buffer=buffer)
                assert status in (_native.SUCCESS, _native.KV_CACHE_NOT_EXIST), message
                if status == _native.KV_CACHE_NOT_EXIST:
                    break
                if last_good is None:
                    swap.start()
                last_good = buffer
                assert time.monotonic() < deadline, "the unregistration was never noticed"
            swap.join(timeout=10)
            assert last_good is not None, "the first pull of the round failed"
            assert puller.source_tag(buffer=last_good) == expected_tag
            puller.relink(peer)
            expected_tag = new_tag
        assert puller.pull() == (0, "")
        assert puller.source_tag() == expected_tag
    finally:
        puller.close()
        peer.stop()
