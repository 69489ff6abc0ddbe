"""The v2 calls beyond pull_blocks and push_blocks, against real processes where a peer is
involved: caches from the engine's pools, copies inside a process, the layer-wise push
(transfer_cache_async) and the names CANN's package exports."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hixl_connector.datadist as datadist
from hixl_connector.datadist import LLMException, LLMStatusCode

from . import datadist_peer as layout

NB, NT, BB = layout.NUM_BLOCKS, layout.NUM_TENSORS, layout.BLOCK_BYTES
ROW = layout.CONTIG_ROW_BYTES
CONTIG = layout.make_tensors("contig", NT, layout.CONTIG_ROWS * ROW)
KV = layout.make_tensors("kv", NT, NB * BB)
POOL_BYTES = 1 << 20


def _code(exc: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc.value.status_code


@pytest.fixture(scope="module")
def env(peer_factory: Any, client_factory: Any, datadist_backend: str) -> Iterator[Any]:
    if datadist_backend != "native":
        pytest.skip("the native engine's implementation of these calls")
    peer = peer_factory(31)
    client = client_factory(
        cluster_id=3100,
        host_mem_pool_cfg=f'{{"memory_size": {POOL_BYTES}}}',
        mem_pool_cfg=f'{{"memory_size": {POOL_BYTES}}}',
    )
    ok = LLMStatusCode.LLM_SUCCESS
    assert client.link(peer) == (ok, [ok])
    yield client, peer
    client.unlink(peer)


def _bytes(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def test_every_v2_name_is_exported() -> None:
    for name in ("KvCache", "MemInfo", "LayerSynchronizer", "TransferConfig", "CacheTask"):
        assert hasattr(datadist, name), name
    assert hasattr(datadist, "TransferWithCacheKeyConfig")
    info = datadist.MemInfo(datadist.Memtype.MEM_TYPE_DEVICE, 4096, 8)
    assert (info.addr, info.size) == (4096, 8)
    with pytest.raises(TypeError):
        datadist.MemInfo(0, 4096, 8)  # type: ignore[arg-type]
    desc = datadist.CacheDesc(2, [4, 8], datadist.DataType.DT_UINT8, datadist.Placement.HOST)
    cpu = datadist.KvCache.create_cpu_cache(desc, [4096, 8192])
    assert cpu.per_device_tensor_addrs == [[4096, 8192]]
    with pytest.raises(LLMException):
        datadist.KvCache.create_cpu_cache(desc, [4096])
    with pytest.raises(TypeError):
        datadist.LayerSynchronizer()  # type: ignore[abstract]
    with pytest.raises(TypeError):  # both ranges are required
        datadist.TransferWithCacheKeyConfig(datadist.BlocksCacheKey(1, 0), range(0, 1))
    with pytest.raises(LLMException):
        datadist.TransferWithCacheKeyConfig(datadist.BlocksCacheKey(1, 0), range(2), range(1))


def test_forced_unlink_of_a_cluster_never_linked_succeeds(env: Any) -> None:
    client, _ = env
    info = client.api.LLMClusterInfo()
    info.remote_cluster_id = 777
    ok = LLMStatusCode.LLM_SUCCESS
    assert client.dd.unlink_clusters([info], 1000, force=True) == (ok, [ok])
    assert client.dd.unlink_clusters([info], 1000)[0] == LLMStatusCode.LLM_NOT_YET_LINK


def test_a_peer_serves_its_allocated_cache_by_key(env: Any) -> None:
    client, peer = env
    cache, tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    key = client.api.CacheKey(peer.cluster_id, layout.ALLOCATED_REQ_ID)
    count = ROW // BB
    client.dd.cache_manager.pull_blocks(key, cache, [], list(range(count)))
    for t in range(NT):
        assert np.array_equal(tensors[t][: count * BB], CONTIG[t][ROW : 2 * ROW])


def _desc(api: Any, placement: Any, rows: int = 2, blocks: bool = False) -> Any:
    shape = [NB, *layout.BLOCK_SHAPE] if blocks else [rows, ROW]
    dtype = api.DataType.DT_BF16 if blocks else api.DataType.DT_UINT8
    return api.CacheDesc(NT, shape, dtype, placement)


def test_allocated_caches_copies_and_key_removal(env: Any) -> None:
    client, peer = env
    api, cm = client.api, client.dd.cache_manager
    keys = [api.CacheKey(3100, 1), api.CacheKey(3100, 2)]
    mine = cm.allocate_cache(_desc(api, api.Placement.HOST), keys)
    other = cm.allocate_cache(_desc(api, api.Placement.DEVICE))
    with pytest.raises(LLMException) as info:
        cm.allocate_cache(_desc(api, api.Placement.HOST), [keys[0]])
    assert _code(info) == LLMStatusCode.LLM_PARAM_INVALID  # the key is bound already
    with pytest.raises(LLMException) as info:
        cm.allocate_cache(_desc(api, api.Placement.HOST, rows=64))
    assert _code(info) == LLMStatusCode.LLM_OUT_OF_MEMORY
    for t, addr in enumerate(mine.tensor_addrs):
        ctypes.memmove(addr + ROW, CONTIG[t].ctypes.data, ROW)
    cm.copy_cache(other, mine, 0, 1, offset=16, size=64)
    for t in range(NT):
        assert _bytes(other.tensor_addrs[t] + 16, 64) == CONTIG[t][16:80].tobytes()
        assert _bytes(other.tensor_addrs[t], 16) == bytes(16)
    with pytest.raises(LLMException) as info:
        cm.copy_cache(other, mine, 0, 2)
    assert _code(info) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        cm.unregister_cache(mine.cache_id)  # allocated: deallocate it
    cm.remove_cache_key(keys[0])
    cm.remove_cache_key(api.CacheKey(3100, 99))  # unknown: left as is
    cm.deallocate_cache(mine)
    cm.deallocate_cache(mine)  # released already: a no-op, as in CANN
    assert mine.tensor_addrs == []
    cm.deallocate_cache(other)
    # The pool is whole again.
    whole = cm.allocate_cache(_desc(api, api.Placement.HOST, rows=POOL_BYTES // (NT * ROW)))
    cm.deallocate_cache(whole)
    with pytest.raises(LLMException):
        cm.deallocate_blocks_cache(whole)


def test_copy_blocks_and_swap_blocks(env: Any) -> None:
    client, _ = env
    api, cm = client.api, client.dd.cache_manager
    cache = cm.allocate_blocks_cache(_desc(api, api.Placement.DEVICE, blocks=True))
    for t, addr in enumerate(cache.tensor_addrs):
        ctypes.memmove(addr, KV[t].ctypes.data, NB * BB)
    cm.copy_blocks(cache, {3: [7, 8], 5: [0]})
    for t, addr in enumerate(cache.tensor_addrs):
        for src, dst in ((3, 7), (3, 8), (5, 0)):
            assert _bytes(addr + dst * BB, BB) == KV[t][src * BB : (src + 1) * BB].tobytes()
    with pytest.raises(LLMException):
        cm.copy_blocks(cache, {NB: [0]})
    host = [np.zeros(NB * BB, np.uint8) for _ in range(NT)]
    cpu = api.Cache.create_cpu_cache(
        _desc(api, api.Placement.HOST, blocks=True), [t.ctypes.data for t in host]
    )
    cm.swap_blocks(cache, cpu, {7: 1, 9: 2})
    for t in range(NT):
        assert host[t][BB : 2 * BB].tobytes() == KV[t][3 * BB : 4 * BB].tobytes()
        assert host[t][2 * BB : 3 * BB].tobytes() == KV[t][9 * BB : 10 * BB].tobytes()
    with pytest.raises(LLMException):
        cm.swap_blocks(cpu, cpu, {0: 1})  # HOST to HOST is not a swap
    with pytest.raises(LLMException) as info:
        cm.copy_blocks(cpu, {0: [1]})  # a CPU cache is no registered cache
    assert _code(info) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    cm.deallocate_blocks_cache(cache)


class Gate(datadist.LayerSynchronizer):
    """Lets layers through as the test releases them; False for a layer in `refuse`."""

    def __init__(self, refuse: int = -1) -> None:
        self.asked: list[int] = []
        self.released = threading.Semaphore(0)
        self.refuse = refuse

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        self.released.acquire()
        return layer_index != self.refuse


def test_transfer_cache_async_pushes_layer_by_layer(env: Any) -> None:
    client, peer = env
    api, cm = client.api, client.dd.cache_manager
    src = cm.allocate_blocks_cache(_desc(api, api.Placement.DEVICE, blocks=True))
    for t, addr in enumerate(src.tensor_addrs):
        ctypes.memset(addr, 0x40 + t, NB * BB)
    back, tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    key = api.BlocksCacheKey(peer.cluster_id, 0)
    config = datadist.TransferWithCacheKeyConfig(key, range(1, 3), range(2, 4))
    gate = Gate()
    task = cm.transfer_cache_async(src, gate, [config], [4, 5], [40, 41])
    assert task.synchronize(50) == LLMStatusCode.LLM_TIMEOUT  # layer 1 is held
    gate.released.release()
    gate.released.release()
    assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS
    assert gate.asked == [1, 2] and task.get_results() == [LLMStatusCode.LLM_SUCCESS]
    cm.pull_blocks(key, back, [40, 41], [40, 41])
    for t in range(NT):
        # Tensors 4-7 (layers 2, 3) hold source tensors 2-5 (layers 1, 2); the rest is as was.
        want = bytes([0x40 + t - 2]) * 2 * BB if 4 <= t < 8 else KV[t][40 * BB : 42 * BB]
        assert bytes(tensors[t][40 * BB : 42 * BB]) == bytes(want), t
    refused = Gate(refuse=0)
    refused.released.release()
    task = cm.transfer_cache_async(
        src, refused, [datadist.TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))]
    )
    assert task.synchronize(5000) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):  # raw addresses need a peer without remote cache access
        cm.transfer_cache_async(src, Gate(), [datadist.TransferConfig(peer.cluster_id, [1, 2])])
    cm.deallocate_blocks_cache(src)


def test_transfer_cache_async_onto_a_peer_row(env: Any) -> None:
    client, peer = env
    api, cm = client.api, client.dd.cache_manager
    src = cm.allocate_cache(_desc(api, api.Placement.DEVICE))
    for t, addr in enumerate(src.tensor_addrs):
        ctypes.memset(addr + ROW, 0x60 + t, ROW)  # row 1
    row = api.CacheKeyByIdAndIndex(peer.cluster_id, peer.caches["contig"], 1)
    config = datadist.TransferWithCacheKeyConfig(row, range(2, 3), range(0, 1), src_batch_index=1)
    gate = Gate()
    gate.released.release()
    task = cm.transfer_cache_async(src, gate, [config])
    assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS and gate.asked == [2]
    landed = [np.zeros(2 * ROW, np.uint8) for _ in range(NT)]
    into = cm.register_cache(
        _desc(api, api.Placement.HOST), [t.ctypes.data for t in landed], remote_accessible=True
    )
    cm.pull_cache(row, into, 1)
    for t in range(NT):  # layer 2 (tensors 4, 5) of row 1 landed on layer 0 of the peer's row
        want = bytes([0x60 + t + 4]) * ROW if t < 2 else CONTIG[t][ROW : 2 * ROW].tobytes()
        assert landed[t][ROW:].tobytes() == want, t
    cm.unregister_cache(into.cache_id)
    with pytest.raises(LLMException) as info:  # a cache into blocks needs raw block sizes
        cm.transfer_cache_async(src, Gate(), [config], None, [0], 64)
    assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    cm.deallocate_cache(src)
