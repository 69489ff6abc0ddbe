"""pull_blocks between real processes, byte for byte, over both transports.

The peer (datadist_peer.py) serves deterministic caches; this process is the decode side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

from hixl_connector.datadist import BlocksPull

from . import datadist_peer as layout
from .datadist_harness import OVER_A_LINKED_SETUP, Client, LinkedSetup, Peer, block_pairs

NB = layout.NUM_BLOCKS
KV = layout.make_tensors("kv", layout.NUM_TENSORS, NB * layout.BLOCK_BYTES)
CONTIG = layout.make_tensors(
    "contig", layout.NUM_TENSORS, layout.CONTIG_ROWS * layout.CONTIG_ROW_BYTES
)
BB = layout.BLOCK_BYTES


class Setup(LinkedSetup):
    def __init__(self, client: Client, peer: Peer, transport: str) -> None:
        super().__init__(client, peer, transport)
        self.cache, self.dst = client.blocks_cache(layout.NUM_TENSORS, NB, layout.BLOCK_SHAPE)

    def reset(self) -> None:
        for tensor in self.dst:
            tensor[:] = 0

    def pull(self, src: Any, dst: Any, key: Any = None, **kwargs: Any) -> None:
        self.reset()
        self.client.dd.cache_manager.pull_blocks(key or self.key, self.cache, src, dst, **kwargs)

    def expect(self, pairs: list[tuple[int, int]], tensors: range, dst_tensors: range) -> None:
        """dst tensor dst_tensors[i] holds src tensor tensors[i]'s blocks at the paired ids,
        and nothing else was written."""
        written: dict[int, set[int]] = {t: set() for t in range(layout.NUM_TENSORS)}
        for s_t, d_t in zip(tensors, dst_tensors, strict=True):
            for src_block, dst_block in pairs:
                got = self.dst[d_t][dst_block * BB : (dst_block + 1) * BB]
                want = KV[s_t][src_block * BB : (src_block + 1) * BB]
                assert np.array_equal(got, want), (s_t, d_t, src_block, dst_block)
                written[d_t].add(dst_block)
        for t, tensor in enumerate(self.dst):
            untouched = [b for b in range(NB) if b not in written[t]]
            view = tensor.reshape(NB, BB)[untouched]
            assert not view.any(), f"tensor {t}: bytes written outside the requested blocks"


@pytest.fixture(scope="module")
def peer(peer_factory: Any) -> Peer:
    return peer_factory(11)


@pytest.fixture(scope="module", params=["cma", "tcp"])
def setup(request: pytest.FixtureRequest, peer: Peer, client_factory: Any) -> Iterator[Setup]:
    yield from Setup.linked(client_factory(hixl_transport=request.param), peer, request.param)


@settings(OVER_A_LINKED_SETUP, max_examples=25)
@given(pairs=block_pairs(NB))
def test_random_block_lists_byte_for_byte(setup: Setup, pairs: list[tuple[int, int]]) -> None:
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    setup.pull(src, tuple(dst))
    everything = range(layout.NUM_TENSORS)
    setup.expect(pairs, everything, everything)


def _tensors(layers: range | None, n: int) -> range:
    return range(layout.NUM_TENSORS) if layers is None else range(layers.start * n, layers.stop * n)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("src_layers", "dst_layers"),
    [
        (range(1, 3), range(0, 2)),
        (range(0, 1), range(3, 4)),
        (range(0, 4), None),
        (None, range(0, 4)),
        (range(3, 4), None),
        (None, None),
    ],
)
def test_layer_ranges(setup: Setup, n: int, src_layers: Any, dst_layers: Any) -> None:
    """Layer l is tensors [l*n, (l+1)*n); a missing range means every tensor of that side."""
    pairs = [(5, 9), (6, 10), (40, 2)]
    kwargs: dict[str, Any] = {"tensor_num_per_layer": n}
    if src_layers is not None:
        kwargs["src_layer_range"] = src_layers
    if dst_layers is not None:
        kwargs["dst_layer_range"] = dst_layers
    src_t, dst_t = _tensors(src_layers, n), _tensors(dst_layers, n)
    args = ([p[0] for p in pairs], [p[1] for p in pairs])
    if len(src_t) != len(dst_t):
        with pytest.raises(setup.api.LLMException) as info:
            setup.pull(*args, **kwargs)
        assert info.value.status_code == setup.api.LLMStatusCode.LLM_PARAM_INVALID
        return
    setup.pull(*args, **kwargs)
    setup.expect(pairs, src_t, dst_t)


@pytest.mark.parametrize("req_id", layout.CONTIG_REQ_IDS)
def test_cache_key_into_blocks(setup: Setup, req_id: int) -> None:
    """A contiguous row is cut into destination-block-sized slices, slice i -> dst_blocks[i]."""
    row = layout.CONTIG_REQ_IDS.index(req_id)
    dst = [30, 3, 17]
    setup.pull((), dst, key=setup.api.CacheKey(setup.peer.cluster_id, req_id))
    for t in range(layout.NUM_TENSORS):
        base = row * layout.CONTIG_ROW_BYTES
        for i, block in enumerate(dst):
            want = CONTIG[t][base + i * BB : base + (i + 1) * BB]
            assert np.array_equal(setup.dst[t][block * BB : (block + 1) * BB], want)


def test_cache_key_by_id_and_index_into_blocks(setup: Setup) -> None:
    key = setup.api.CacheKeyByIdAndIndex(setup.peer.cluster_id, setup.peer.caches["contig"], 1)
    dst = list(range(8))  # the whole row
    setup.pull([], dst, key=key)
    for t in range(layout.NUM_TENSORS):
        row = CONTIG[t][layout.CONTIG_ROW_BYTES : 2 * layout.CONTIG_ROW_BYTES]
        assert np.array_equal(setup.dst[t][: 8 * BB], row)


def test_a_batch_of_one_is_an_asynchronous_pull(setup: Setup) -> None:
    setup.reset()
    pairs = [(1, 60), (2, 61), (50, 0)]
    handle = setup.api.pull_blocks_batch_async(
        setup.client.dd.cache_manager, [BlocksPull(setup.key, setup.cache, [1, 2, 50], [60, 61, 0])]
    )
    assert handle.wait(10.0) is True
    assert handle.poll() is True  # the result is kept
    everything = range(layout.NUM_TENSORS)
    setup.expect(pairs, everything, everything)


def _batch(setup: Setup, pairs: list[tuple[Any, int]]) -> None:
    setup.reset()
    pulls = [BlocksPull(setup.key, setup.cache, [s], [d]) for s, d in pairs]
    manager = setup.client.dd.cache_manager
    before = time.monotonic()
    handle = setup.api.pull_blocks_batch_async(manager, pulls)
    try:
        assert handle.wait(10.0) is True
    finally:
        assert handle.finished_at is not None and before < handle.finished_at < time.monotonic()


def test_batch_extension_pulls_in_order(setup: Setup) -> None:
    _batch(setup, [(1, 60), (2, 61), (5, 60)])  # the last into 60 lands last
    everything = range(layout.NUM_TENSORS)
    setup.expect([(5, 60), (2, 61)], everything, everything)


def test_batch_extension_stops_at_the_first_failure(setup: Setup) -> None:
    with pytest.raises(setup.api.LLMException) as info:
        _batch(setup, [(1, 60), (NB, 61), (3, 62)])  # the 2nd reads beyond P's
    assert info.value.status_code == setup.api.LLMStatusCode.LLM_PARAM_INVALID
    everything = range(layout.NUM_TENSORS)
    setup.expect([(1, 60)], everything, everything)  # the third never ran


def test_batch_extension_checks_every_pull_before_any_moves(setup: Setup) -> None:
    with pytest.raises(TypeError):
        _batch(setup, [(1, 60), ("x", 61)])
    everything = range(layout.NUM_TENSORS)
    setup.expect([], everything, everything)
