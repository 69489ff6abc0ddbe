"""push_blocks between real processes, byte for byte, over both transports.

This process writes its blocks into a peer's cache (datadist_peer.py), then reads the peer's
whole cache back with pull_blocks and compares it with a model of what the peer must hold:
its initial bytes, with every successful push applied and nothing else changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

from . import datadist_peer as layout
from .datadist_harness import OVER_A_LINKED_SETUP, Client, LinkedSetup, Peer, block_pairs

NB = layout.NUM_BLOCKS
NT = layout.NUM_TENSORS
BB = layout.BLOCK_BYTES
EVERY_BLOCK = list(range(NB))


class PushSetup(LinkedSetup):
    """A client with a source cache of its own bytes, a read-back cache, and the model of the
    peer's "kv" cache."""

    def __init__(self, client: Client, peer: Peer, transport: str) -> None:
        super().__init__(client, peer, transport)
        self.cm = client.dd.cache_manager
        self.src, self.src_tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
        for t, tensor in enumerate(self.src_tensors):
            tensor[:] = layout.tensor_bytes(99, transport, t, tensor.nbytes)
        self.back, self.back_tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
        self.model = [t.reshape(NB, BB).copy() for t in layout.make_tensors("kv", NT, NB * BB)]

    def push(self, pairs: list[tuple[int, int]], **kwargs: Any) -> None:
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        self.cm.push_blocks(self.key, self.src, src, dst, **kwargs)

    def landed(self, pairs: list[tuple[int, int]], src_tensors: range, dst_tensors: range) -> None:
        for s_t, d_t in zip(src_tensors, dst_tensors, strict=True):
            mine = self.src_tensors[s_t].reshape(NB, BB)
            for src_block, dst_block in pairs:
                self.model[d_t][dst_block] = mine[src_block]

    def assert_peer_matches_model(self) -> None:
        for tensor in self.back_tensors:
            tensor[:] = 0
        self.cm.pull_blocks(self.key, self.back, EVERY_BLOCK, EVERY_BLOCK)
        for t in range(NT):
            got = self.back_tensors[t].reshape(NB, BB)
            wrong = [b for b in range(NB) if not np.array_equal(got[b], self.model[t][b])]
            assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"


@pytest.fixture(scope="module", params=["cma", "tcp"])
def setup(
    request: pytest.FixtureRequest, peer_factory: Any, client_factory: Any
) -> Iterator[PushSetup]:
    peer = peer_factory(21 if request.param == "cma" else 22)
    client = client_factory(hixl_transport=request.param)
    yield from PushSetup.linked(client, peer, request.param)


@settings(OVER_A_LINKED_SETUP, max_examples=20)
@given(pairs=block_pairs(NB))
def test_random_block_lists_land_byte_for_byte(
    setup: PushSetup, pairs: list[tuple[int, int]]
) -> None:
    setup.push(pairs)
    setup.landed(pairs, range(NT), range(NT))
    setup.assert_peer_matches_model()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    ("src_layers", "dst_layers"),
    [(range(1, 3), range(0, 2)), (range(0, 1), range(3, 4)), (None, None), (range(2, 4), None)],
)
def test_layer_ranges(setup: PushSetup, n: int, src_layers: Any, dst_layers: Any) -> None:
    """Layer l is tensors [l*n, (l+1)*n); a missing range means every layer of the source
    cache (num_tensors // n), and the two ranges must be equally long."""
    pairs = [(3, 11), (4, 12), (50, 7)]
    every = range(NT // n)
    src_l = every if src_layers is None else src_layers
    dst_l = every if dst_layers is None else dst_layers
    kwargs: dict[str, Any] = {"tensor_num_per_layer": n}
    if src_layers is not None:
        kwargs["src_layer_range"] = src_layers
    if dst_layers is not None:
        kwargs["dst_layer_range"] = dst_layers
    if len(src_l) != len(dst_l):
        with pytest.raises(setup.api.LLMException) as info:
            setup.push(pairs, **kwargs)
        assert info.value.status_code == setup.api.LLMStatusCode.LLM_PARAM_INVALID
    else:
        setup.push(pairs, **kwargs)
        tensors = range(src_l.start * n, src_l.stop * n), range(dst_l.start * n, dst_l.stop * n)
        setup.landed(pairs, *tensors)
    setup.assert_peer_matches_model()


def _refused(setup: PushSetup, code: str, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(setup.api.LLMException) as info:
        setup.cm.push_blocks(*args, **kwargs)
    assert info.value.status_code == getattr(setup.api.LLMStatusCode, code), info.value
    return str(info.value)


def test_refusals_write_nothing(setup: PushSetup) -> None:
    """Each documented refusal, and the peer's cache is unchanged after all of them."""
    api, key, src = setup.api, setup.key, setup.src
    peer = setup.peer.cluster_id
    message = _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [NB])
    assert f"dst_blocks[0]={NB}" in message
    _refused(setup, "LLM_PARAM_INVALID", key, src, [NB], [0])
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0, 1], [0])
    _refused(setup, "LLM_PARAM_INVALID", key, src, [], [0])
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [])
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [0], src_layer_range=range(2, 2))
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [0], src_layer_range=range(0, 4, 2))
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [0], tensor_num_per_layer=0)
    _refused(setup, "LLM_PARAM_INVALID", key, src, [0], [0], dst_layer_range=range(3, 5))
    _refused(setup, "LLM_KV_CACHE_NOT_EXIST", api.BlocksCacheKey(peer, 9), src, [0], [0])
    hidden = api.BlocksCacheKey(peer, layout.HIDDEN_MODEL_ID)  # not remote-accessible
    _refused(setup, "LLM_KV_CACHE_NOT_EXIST", hidden, src, [0], [0])
    _refused(setup, "LLM_NOT_YET_LINK", api.BlocksCacheKey(peer + 500, 0), src, [0], [0])
    with pytest.raises(TypeError):
        setup.cm.push_blocks(api.CacheKey(peer, 1), src, [0], [0])
    with pytest.raises(TypeError):
        setup.cm.push_blocks(key, src, [0], [-1])
    with pytest.raises(TypeError):
        setup.cm.push_blocks(key, src, [0], [0], src_layer_range=[0, 1])
    setup.assert_peer_matches_model()


def test_a_push_counts_on_both_sides(setup: PushSetup) -> None:
    if not hasattr(setup.client.dd, "engine_stats"):
        pytest.skip("engine counters are a native-engine extension")
    before = setup.client.dd.engine_stats()
    pairs = [(0, 20), (1, 21), (2, 22)]
    setup.push(pairs)
    setup.landed(pairs, range(NT), range(NT))
    after = setup.client.dd.engine_stats()
    assert after["pushes"] == before["pushes"] + 1
    assert after["pushed_bytes"] == before["pushed_bytes"] + 3 * NT * BB
    setup.assert_peer_matches_model()
