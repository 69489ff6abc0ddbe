"""Large pulls are cut into chunks (cma) or shares (tcp) at byte offsets inside ops; every byte
still lands where it belongs and nothing else is written."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .datadist_harness import register_and_link, serving
from .native_peer import BLOCKS_CACHE_ID, MODEL_ID, NativePeer, pattern

PEER_CLUSTER = 32
TENSORS = 8
BLOCKS = 512
BLOCK_BYTES = 12296  # not a power of two: chunk boundaries fall inside ops
PULLED = 401  # 3208 ops, ~39 MB: 32 chunks of ~1.23 MB over two threads
DST_CACHE = 4
SENTINEL = 0x5A
TIMEOUT_MS = 10000


@pytest.fixture(scope="module")
def peer() -> Iterator[NativePeer]:
    yield from serving(PEER_CLUSTER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_chunked_pull_is_byte_exact(peer: NativePeer, transport: str) -> None:
    engine = _native.Engine(201, transport=transport, transfer_threads=2)
    try:
        tensors = [np.full(BLOCKS * BLOCK_BYTES, SENTINEL, np.uint8) for _ in range(TENSORS)]
        register_and_link(engine, DST_CACHE, tensors, BLOCKS, peer, TIMEOUT_MS)
        rng = np.random.default_rng(8)
        src = rng.choice(BLOCKS, PULLED, replace=False).astype(np.int64)
        dst = rng.choice(BLOCKS, PULLED, replace=False).astype(np.int64)
        status, msg = engine.pull(
            PEER_CLUSTER, 0, MODEL_ID, -1, -1, -1, 0, DST_CACHE, src, dst, 0, -1, 0, -1, TIMEOUT_MS
        )
        assert status == _native.SUCCESS, msg
        untouched = np.setdiff1d(np.arange(BLOCKS), dst)
        for t, data in enumerate(tensors):
            got = data.reshape(BLOCKS, BLOCK_BYTES)
            want = pattern(PEER_CLUSTER, BLOCKS_CACHE_ID, t, BLOCKS * BLOCK_BYTES)
            assert np.array_equal(got[dst], want.reshape(BLOCKS, BLOCK_BYTES)[src]), t
            assert (got[untouched] == SENTINEL).all(), t
    finally:
        engine.close()
