"""Every documented pull_blocks / register error through the API, against a real peer process,
with its exact exception type and status code (reference table 6.3; rows 1, 20 and 28 are in
test_datadist_link.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hixl_connector.datadist import BlocksPull

from . import datadist_peer as layout
from .datadist_harness import Client, Peer

NB = layout.NUM_BLOCKS


class Env:
    def __init__(self, client: Client, peer: Peer) -> None:
        self.client, self.peer, self.api = client, peer, client.api
        self.cm = client.dd.cache_manager
        self.cache, _ = client.blocks_cache(layout.NUM_TENSORS, NB, layout.BLOCK_SHAPE)
        self.closed, _ = client.blocks_cache(layout.NUM_TENSORS, NB, layout.BLOCK_SHAPE)
        self.private, _ = client.blocks_cache(
            layout.NUM_TENSORS, NB, layout.BLOCK_SHAPE, accessible=False
        )
        self.key = self.api.BlocksCacheKey(peer.cluster_id, 0)

    def status_of(self, *args: Any, **kwargs: Any) -> Any:
        with pytest.raises(self.api.LLMException) as info:
            self.cm.pull_blocks(*args, **kwargs)
        return info.value.status_code


@pytest.fixture(scope="module")
def env(peer_factory: Any, client_factory: Any) -> Iterator[Env]:
    peer = peer_factory(21)
    client = client_factory(cluster_id=2100)
    e = Env(client, peer)
    e.cm.unregister_cache(e.closed.cache_id)
    ok = e.api.LLMStatusCode.LLM_SUCCESS
    assert client.link(peer) == (ok, [ok])
    yield e
    client.unlink(peer)


def codes(env: Env) -> Any:
    return env.api.LLMStatusCode


def test_unknown_kwarg_raises_type_error(env: Env) -> None:
    with pytest.raises(TypeError, match="tensor_num_per_layers"):
        env.cm.pull_blocks(env.key, env.cache, [1], [1], tensor_num_per_layers=1)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("key", "cache", [1], [1]), {}),  # row 3
        ((None, "cache", [1], [1]), {}),
        (("KEY", None, [1], [1]), {}),  # row 4
        (("KEY", "CACHE", None, [1]), {}),  # rows 5-6
        (("KEY", "CACHE", [1], [1.5]), {}),
        (("KEY", "CACHE", [1], [1]), {"tensor_num_per_layer": "2"}),  # row 9
        (("KEY", "CACHE", [1], [1]), {"src_layer_range": [0, 1]}),  # row 12
        (("KEY", "CACHE", [-1], [1]), {}),  # row 16
    ],
)
def test_type_errors(env: Env, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    real = [env.key if a == "KEY" else env.cache if a == "CACHE" else a for a in args]
    with pytest.raises(TypeError):
        env.cm.pull_blocks(*real, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tensor_num_per_layer": -1},
        {"tensor_num_per_layer": 2**32},
        {"src_layer_range": range(2**32, 2**32 + 1)},
    ],
)
def test_value_errors(env: Env, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        env.cm.pull_blocks(env.key, env.cache, [1], [1], **kwargs)


def test_param_rows_7_to_14(env: Env) -> None:
    param = codes(env).LLM_PARAM_INVALID
    assert env.status_of(env.key, env.cache, [1], []) == param  # row 8
    assert env.status_of(env.key, env.cache, [1], [1], tensor_num_per_layer=0) == param  # 10
    assert env.status_of(env.key, env.cache, [], [1]) == param  # row 11
    by_id = env.api.CacheKeyByIdAndIndex(env.peer.cluster_id, env.peer.caches["contig"])
    assert env.status_of(by_id, env.cache, [1], [1]) == param
    assert (
        env.status_of(env.api.CacheKey(env.peer.cluster_id, 2**64 - 1), env.cache, [], [1]) == param
    )
    assert env.status_of(env.key, env.cache, [1], [1], src_layer_range=range(0, 4, 2)) == param
    assert env.status_of(env.key, env.cache, [1], [1], dst_layer_range=range(-1, 1)) == param
    assert env.status_of(env.key, env.cache, [1], [1], src_layer_range=range(2, 2)) == param


def test_row7_contiguous_destination(env: Env) -> None:
    tensors = [np.zeros(1024, np.uint8) for _ in range(2)]
    env.client.keep += tensors
    desc = env.api.CacheDesc(2, [2, 512], env.api.DataType.DT_UINT8, env.api.Placement.HOST)
    contiguous = env.cm.register_cache(desc, [t.ctypes.data for t in tensors])
    assert env.status_of(env.key, contiguous, [1], [1]) == codes(env).LLM_PARAM_INVALID


def test_row17_unregistered_destination(env: Env) -> None:
    assert env.status_of(env.key, env.closed, [1], [1]) == codes(env).LLM_KV_CACHE_NOT_EXIST


def test_row18_local_destination_rules(env: Env) -> None:
    param = codes(env).LLM_PARAM_INVALID
    assert env.status_of(env.key, env.cache, [1], [NB]) == param
    assert env.status_of(env.key, env.cache, [1, 2], [1]) == param
    assert (
        env.status_of(
            env.key, env.cache, [1], [1], tensor_num_per_layer=3, src_layer_range=range(1)
        )
        == param
    )
    assert env.status_of(env.key, env.cache, [1], [1], dst_layer_range=range(3, 5)) == param


def test_row19_not_linked(env: Env) -> None:
    key = env.api.BlocksCacheKey(env.peer.cluster_id + 1000, 0)
    assert env.status_of(key, env.cache, [1], [1]) == codes(env).LLM_NOT_YET_LINK


def test_row24_remote_cache_missing(env: Env) -> None:
    missing = codes(env).LLM_KV_CACHE_NOT_EXIST
    cid = env.peer.cluster_id
    assert env.status_of(env.api.BlocksCacheKey(cid, 5), env.cache, [1], [1]) == missing
    assert env.status_of(env.api.CacheKeyByIdAndIndex(cid, 999), env.cache, [], [1]) == missing
    assert env.status_of(env.api.CacheKey(cid, 99), env.cache, [], [1]) == missing


def test_blocks_cache_registered_under_another_clusters_key_is_not_found(env: Env) -> None:
    key = env.api.BlocksCacheKey(env.peer.cluster_id, layout.FOREIGN_MODEL_ID)
    assert env.status_of(key, env.cache, [1], [1]) == codes(env).LLM_KV_CACHE_NOT_EXIST


def test_row25_local_destination_not_remote_accessible(env: Env) -> None:
    assert env.status_of(env.key, env.private, [1], [1]) == codes(env).LLM_PARAM_INVALID


def test_row26_remote_source_not_remote_accessible(env: Env, datadist_backend: str) -> None:
    hidden = env.api.BlocksCacheKey(env.peer.cluster_id, layout.HIDDEN_MODEL_ID)
    # The native engine never publishes such a cache, so the peer has no cache under that key.
    expected = "LLM_KV_CACHE_NOT_EXIST" if datadist_backend == "native" else "LLM_PARAM_INVALID"
    assert env.status_of(hidden, env.cache, [1], [1]) == getattr(codes(env), expected)


def test_row27_remote_ranges(env: Env) -> None:
    param = codes(env).LLM_PARAM_INVALID
    cid = env.peer.cluster_id
    assert env.status_of(env.key, env.cache, [NB], [1]) == param
    assert (
        env.status_of(
            env.key, env.cache, [1], [1], src_layer_range=range(3, 5), dst_layer_range=range(0, 2)
        )
        == param
    )
    by_id = env.api.CacheKeyByIdAndIndex(cid, env.peer.caches["contig"], layout.CONTIG_ROWS)
    assert env.status_of(by_id, env.cache, [], [1]) == param
    row_blocks = layout.CONTIG_ROW_BYTES // layout.BLOCK_BYTES
    too_many = list(range(row_blocks + 1))
    assert env.status_of(env.api.CacheKey(cid, 7), env.cache, [], too_many) == param


def test_blocks_of_another_size_are_refused_naming_both(env: Env) -> None:
    """The planner itself refuses a source whose blocks differ in size from the
    destination's: nothing would land where it belongs."""
    tokens, heads, dim = layout.BLOCK_SHAPE
    halved, tensors = env.client.blocks_cache(layout.NUM_TENSORS, NB, (tokens // 2, heads, dim))
    with pytest.raises(env.api.LLMException, match=f"blocks of {layout.BLOCK_BYTES} bytes") as e:
        env.cm.pull_blocks(env.key, halved, [1], [1])
    assert e.value.status_code == codes(env).LLM_PARAM_INVALID
    assert not any(tensor.any() for tensor in tensors)  # nothing landed
    env.cm.unregister_cache(halved.cache_id)


def test_register_errors(env: Env) -> None:
    api = env.api
    host = api.CacheDesc(2, [4, 8], api.DataType.DT_UINT8, api.Placement.HOST)
    mem = np.zeros(64, np.uint8)
    env.client.keep.append(mem)
    with pytest.raises(TypeError):
        env.cm.register_blocks_cache(host, (mem.ctypes.data, mem.ctypes.data + 32))
    with pytest.raises(api.LLMException) as info:
        env.cm.register_blocks_cache(host, [])
    assert info.value.status_code == codes(env).LLM_PARAM_INVALID
    with pytest.raises(api.LLMException) as info:
        env.cm.register_blocks_cache(host, [mem.ctypes.data])
    assert info.value.status_code == codes(env).LLM_PARAM_INVALID
    # Addresses that are not mapped memory of this process (an accelerator's, a freed
    # buffer's) are refused when registered, not when a peer's transfer faults on them.
    with pytest.raises(api.LLMException, match="not mapped") as info:
        env.cm.register_blocks_cache(host, [mem.ctypes.data, 4096])
    assert info.value.status_code == codes(env).LLM_PARAM_INVALID


def test_device_placement_is_served_as_this_process_memory(env: Env, datadist_backend: str) -> None:
    """The native engine has no device memory: a Placement.DEVICE cache is the host memory
    its addresses name, pullable like any other."""
    if datadist_backend != "native":
        pytest.skip("CANN registers device memory for real")
    api = env.api
    mem = np.zeros(NB * layout.BLOCK_BYTES * layout.NUM_TENSORS, np.uint8)
    tensors = mem.reshape(layout.NUM_TENSORS, -1)
    desc = api.CacheDesc(
        layout.NUM_TENSORS, [NB, *layout.BLOCK_SHAPE], api.DataType.DT_BF16, api.Placement.DEVICE
    )
    cache = env.cm.register_blocks_cache(desc, [t.ctypes.data for t in tensors])
    try:
        env.cm.pull_blocks(env.key, cache, [3], [5])
        want = layout.make_tensors("kv", layout.NUM_TENSORS, NB * layout.BLOCK_BYTES)
        bb = layout.BLOCK_BYTES
        for t in range(layout.NUM_TENSORS):
            assert np.array_equal(tensors[t][5 * bb : 6 * bb], want[t][3 * bb : 4 * bb])
    finally:
        env.cm.unregister_cache(cache.cache_id)


def test_push_cache_from_a_blocks_cache_is_refused(env: Env) -> None:
    with pytest.raises(env.api.LLMException, match="blocks cache") as info:
        env.cm.push_cache(env.api.CacheKeyByIdAndIndex(env.key.cluster_id, 1), env.cache)
    assert info.value.status_code == codes(env).LLM_PARAM_INVALID


def test_push_blocks_needs_remote_accessible_mode(env: Env, datadist_backend: str) -> None:
    """Checked before anything else (reference section 6.5), so no engine is involved."""
    if datadist_backend != "native":
        pytest.skip("builds the native CacheManager directly")
    from hixl_connector.datadist.native.cache_manager import CacheManager

    manager = CacheManager(engine=None, options={}, sync_kv_timeout_ms=1000)
    with pytest.raises(env.api.LLMException, match="enable_remote_cache_accessible") as info:
        manager.push_blocks(env.key, env.cache, [1], [1])
    assert info.value.status_code == codes(env).LLM_PARAM_INVALID


def test_failed_pull_leaves_link_usable(env: Env) -> None:
    env.status_of(env.key, env.cache, [NB + 5], [1])
    env.cm.pull_blocks(env.key, env.cache, [3], [4])


def test_async_pull_failure_surfaces_from_the_handle(env: Env) -> None:
    pull = BlocksPull(env.key, env.cache, [NB], [1])
    handle = env.api.pull_blocks_batch_async(env.cm, [pull])
    for call in (lambda: handle.wait(10.0), handle.poll):  # kept for every later call
        with pytest.raises(env.api.LLMException) as info:
            call()
        assert info.value.status_code == codes(env).LLM_PARAM_INVALID
    bogus = BlocksPull(env.key, env.cache, [1], [1], {"bogus": 1})
    with pytest.raises(TypeError):  # argument errors raise before a handle exists
        env.api.pull_blocks_batch_async(env.cm, [bogus])
