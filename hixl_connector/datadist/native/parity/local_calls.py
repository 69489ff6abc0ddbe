"""The CacheManager calls that stay in this process (LLM-DataDist v2): caches the engine
allocates from its pools (``allocate_cache``, ``allocate_blocks_cache``, their ``deallocate_*``
and ``remove_cache_key``), copies between local caches (``copy_cache``, ``copy_blocks``,
``swap_blocks``) and ``remap_registered_memory``. A mixin of ``CacheManager``, whose
registration it uses."""

from __future__ import annotations

import threading
from typing import Any

from hixl_connector.datadist.api.c_types import check_isinstance, check_uint64, to_int64
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    MemInfo,
    Memtype,
)
from hixl_connector.datadist.api.status import raise_if_false, raise_if_true
from hixl_connector.datadist.native.parity import local_copies
from hixl_connector.datadist.native.parity.allocations import Pools


def _key_tuple(key: CacheKey) -> tuple[int, int, int]:
    return (to_int64(key.req_id), to_int64(key.prefix_id), to_int64(key.model_id))


class LocalCacheCalls:
    """Needs the host class's registry (``_caches``, ``_lock``, ``_pools``) and its engine
    registration (``_add_to_engine``, ``_engine``, ``_next_id``, ``_check_is_inited``)."""

    _caches: dict[int, Cache]
    _lock: threading.Lock
    _pools: Pools
    _engine: Any
    _next_id: Any

    def _check_is_inited(self) -> None: ...

    def _add_to_engine(self, func: str, cache_id: int, cache_desc: CacheDesc, addrs: list[int],
                       is_blocks: bool, served: bool, blocks_model_id: int,
                       cache_keys: list[tuple[int, int, int]]) -> None: ...  # fmt: skip

    # --- caches from the pools --------------------------------------------------------------
    def allocate_cache(
        self, cache_desc: CacheDesc, cache_keys: list[CacheKey] | tuple[CacheKey, ...] = ()
    ) -> Cache:
        """A contiguous cache in pool memory; key i names batch row i. Peers pull it by key
        or by id, like a registered one."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("cache_keys", cache_keys, (list, tuple), CacheKey, allow_none=False)
        keys = [_key_tuple(k) for k in cache_keys]
        raise_if_false(
            len(keys) <= cache_desc.batch_size,
            f"{len(keys)} keys for a cache of batch size {cache_desc.batch_size}",
        )
        raise_if_false(len(set(keys)) == len(keys), "cache_keys holds a key twice")
        return self._allocate("allocate_cache", cache_desc, False, -1, keys)

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        model_id = -1
        if blocks_cache_key is not None and blocks_cache_key.cluster_id == self._engine.cluster_id:
            model_id = to_int64(blocks_cache_key.model_id)
        return self._allocate("allocate_blocks_cache", cache_desc, True, model_id, [])

    def _allocate(
        self,
        func: str,
        desc: CacheDesc,
        is_blocks: bool,
        model_id: int,
        keys: list[tuple[int, int, int]],
    ) -> Cache:
        raise_if_false(desc.num_tensors > 0, "num_tensors must be > 0")
        self._pools.check_placement(desc)
        with self._lock:
            taken = {k for a in self._pools.allocations.values() for k in a.keys}
            raise_if_true(bool(taken & set(keys)), "a key is already bound to another cache")
            allocation = self._pools.take(desc)
            allocation.keys = keys
            cache_id = next(self._next_id)
            try:
                self._add_to_engine(
                    func, cache_id, desc, allocation.addrs, is_blocks, True, model_id, keys
                )
            except BaseException:
                self._pools.give_back(allocation)
                raise
            self._pools.allocations[cache_id] = allocation
            cache = Cache(cache_id, desc, allocation.addrs, self, False, is_blocks, True)
            self._caches[cache_id] = cache
        return cache

    def _deallocate(self, cache: Any, blocks: bool) -> None:
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(
            cache.is_blocks_cache == blocks,
            "use deallocate_blocks_cache for a blocks cache"
            if cache.is_blocks_cache
            else "use deallocate_cache for a contiguous cache",
        )
        with self._lock:
            allocation = self._pools.allocations.pop(cache.cache_id, None)
            if allocation is None:
                return  # registered, not allocated, or already released: as in CANN
            self._engine.unregister_cache(cache.cache_id)  # waits for transfers using it
            self._caches.pop(cache.cache_id, None)
            self._pools.give_back(allocation)
        cache._tensor_addrs = []
        cache._valid = False

    def deallocate_cache(self, cache: Cache) -> None:
        self._deallocate(cache, blocks=False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        self._deallocate(cache, blocks=True)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbinds a key of an allocated cache; its row is no longer pullable by that key.
        An unknown key, or one of a registered cache, is left as is (as in CANN)."""
        self._check_is_inited()
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        key = _key_tuple(cache_key)
        with self._lock:
            for cache_id, allocation in self._pools.allocations.items():
                if key not in allocation.keys:
                    continue
                # The row stays where it is: a key names row i by its place in the list.
                keys = [k if k != key else (-1, -1, -1) for k in allocation.keys]
                cache = self._caches[cache_id]
                self._engine.unregister_cache(cache_id)
                self._add_to_engine(
                    "remove_cache_key", cache_id, cache.cache_desc, allocation.addrs,
                    cache.is_blocks_cache, True, -1, keys,
                )  # fmt: skip
                allocation.keys = keys
                return

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Host memory has no NIC registration to refresh: the arguments are checked as in
        CANN and nothing else happens."""
        self._check_is_inited()
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        raise_if_false(
            isinstance(mem_infos, (list, MemInfo)), "mem_infos must be a MemInfo or a list"
        )
        for i, info in enumerate(infos):
            raise_if_false(isinstance(info, MemInfo), f"mem_infos index={i} is not a MemInfo")
            raise_if_false(
                info.mem_type == Memtype.MEM_TYPE_DEVICE, f"mem_infos index={i}: mem_type"
            )
            raise_if_false(info.addr != 0, f"mem_infos index={i}: addr is 0")
            raise_if_false(info.size > 0, f"mem_infos index={i}: size is not > 0")

    # --- copies in this process -------------------------------------------------------------
    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        self._check_is_inited()
        copies = local_copies.plan_copy_cache(
            dst, src, dst_batch_index, src_batch_index, offset, size
        )
        if req_id is not None:
            check_uint64("req_id", req_id)
        for cache in (dst, src):
            local_copies.check_registered(cache, self._caches)
        local_copies.run(copies)

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        self._check_is_inited()
        copies = local_copies.plan_copy_blocks(cache, copy_block_info)
        local_copies.check_registered(cache, self._caches)
        local_copies.run(copies)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        self._check_is_inited()
        local_copies.run(local_copies.plan_swap_blocks(src_cache, dst_cache, src_to_dst))
