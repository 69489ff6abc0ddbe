"""The engine's own memory stays small for a large scattered pull: plans and iovec batches
only, never a staging copy of the data."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hixl_connector import _native

from .datadist_harness import register_and_link, serving
from .native_peer import BLOCKS_CACHE_ID, MODEL_ID, NativePeer, pattern

PEER_CLUSTER = 31
TENSORS = 64  # the Llama-8B layout: 32 layers, K and V apart
BLOCKS = 256
BLOCK_BYTES = 4096
PULLED = 128  # 2048 tokens in 16-token blocks
DST_CACHE = 9
TIMEOUT_MS = 10000
# Plans (24 B per op) and iovec batches: well under 1 MiB for 8192 ops. A staging copy of
# the 32 MiB pulled here would exceed it many times over.
PEAK_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def peer() -> Iterator[NativePeer]:
    yield from serving(PEER_CLUSTER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_scattered_pull_of_8192_ops_holds_little_memory(peer: NativePeer, transport: str) -> None:
    engine = _native.Engine(200, transport=transport)
    try:
        tensors = [np.zeros(BLOCKS * BLOCK_BYTES, np.uint8) for _ in range(TENSORS)]
        register_and_link(engine, DST_CACHE, tensors, BLOCKS, peer, TIMEOUT_MS)
        assert engine.peer_transport(PEER_CLUSTER) == transport
        rng = np.random.default_rng(5)
        # Even ids only: no two pairs are adjacent on both sides, so every pair is its own run.
        src = rng.permutation(np.arange(0, BLOCKS, 2))[:PULLED].astype(np.int64)
        dst = rng.permutation(np.arange(0, BLOCKS, 2))[:PULLED].astype(np.int64)
        status, msg = engine.pull(
            PEER_CLUSTER, 0, MODEL_ID, -1, -1, -1, 0, DST_CACHE, src, dst, 0, -1, 0, -1, TIMEOUT_MS
        )
        assert status == _native.SUCCESS, msg
        stats = engine.stats()
        assert stats["ops"] == PULLED * TENSORS
        assert stats["bytes"] == PULLED * TENSORS * BLOCK_BYTES
        assert 0 < stats["peak_internal_bytes"] < PEAK_LIMIT, stats
        for t in (0, TENSORS - 1):
            want = pattern(PEER_CLUSTER, BLOCKS_CACHE_ID, t, BLOCKS * BLOCK_BYTES)
            for s, d in zip(src[:8], dst[:8], strict=True):
                got = tensors[t][d * BLOCK_BYTES : (d + 1) * BLOCK_BYTES]
                assert np.array_equal(got, want[s * BLOCK_BYTES : (s + 1) * BLOCK_BYTES])
    finally:
        engine.close()
    if transport == "tcp":
        served = peer.stats()
        assert 0 < served["peak_internal_bytes"] < PEAK_LIMIT, served
