"""CacheManager of the LLM-DataDist v2 API on the project's native engine (host memory)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hixl_connector.datadist.api.c_types import (
    check_int64,
    check_isinstance,
    check_uint64,
    to_int64,
)
from hixl_connector.datadist.api.config import OPT_WRITES_BY_GRANT
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    BlocksPull,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    Placement,
)
from hixl_connector.datadist.api.pull_handle import PullHandle
from hixl_connector.datadist.api.rules import PULL_BLOCKS, PULL_CACHE, Call, Transfer, check
from hixl_connector.datadist.api.status import (
    LLMStatusCode,
    check_status,
    raise_if_false,
    raise_if_true,
)
from hixl_connector.datadist.native.parity.allocations import Pools
from hixl_connector.datadist.native.parity.local_calls import LocalCacheCalls
from hixl_connector.datadist.native.push_calls import PushCalls
from hixl_connector.datadist.native.transfer_args import PullArgs
from hixl_connector.datadist.native.write_grants import WriteGrantCalls


class CacheManager(LocalCacheCalls, WriteGrantCalls, PushCalls):
    """Registers host caches with the engine, pulls blocks from linked peers and pushes
    blocks to them; the calls that stay in this process are LocalCacheCalls', the pushes
    PushCalls', the write grants (an extension) WriteGrantCalls'."""

    def __init__(self, engine: Any, options: dict[str, str], sync_kv_timeout_ms: int) -> None:
        self._engine = engine
        self._initialized = True
        self._remote_cache_accessible = options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        self._writes_by_grant = options.get(OPT_WRITES_BY_GRANT, "0") == "1"
        self._timeout_ms = sync_kv_timeout_ms
        self._caches: dict[int, Cache] = {}
        self._next_id = itertools.count(1)
        self._lock = threading.Lock()
        self._pools = Pools(options)
        # After LLMDataDist.link (rank table), as in CANN: new caches are not remote-accessible.
        self._linked_by_rank_table = False

    def _check_is_inited(self) -> None:
        raise_if_false(
            self._initialized,
            "CacheManager is no longer initialized; obtain a new instance after LLMDataDist.init.",
            status_code=LLMStatusCode.LLM_ENGINE_FINALIZED,
        )

    def _finalize(self) -> None:
        self._initialized = False
        self._caches.clear()

    # --- registration ---------------------------------------------------------------------
    def _register(
        self,
        func: str,
        cache_desc: CacheDesc,
        addrs: list[int],
        is_blocks: bool,
        remote_accessible: bool | None,
        blocks_model_id: int,
        cache_keys: list[tuple[int, int, int]],
    ) -> Cache:
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        # The native engine has no device memory: a Placement.DEVICE cache is served as what
        # its addresses are, this process's memory (the engine refuses addresses that are
        # not mapped here, such as an accelerator's).
        raise_if_false(
            len(addrs) == cache_desc.num_tensors,
            f"addrs length {len(addrs)} should be equal to num_tensors {cache_desc.num_tensors}.",
        )
        raise_if_true(0 in addrs, "addr can not be zero.")
        raise_if_true(
            self._linked_by_rank_table and remote_accessible is True,
            "remote_accessible=True is not supported after LLMDataDist.link",
        )
        # CANN: None means True for DEVICE and False for HOST memory (False after link()).
        accessible = (
            cache_desc.placement == Placement.DEVICE and not self._linked_by_rank_table
            if remote_accessible is None
            else remote_accessible
        )
        # Without remote-accessible mode CANN serves every cache through the owner process, so
        # every cache must be visible to peers; with it, only the remote-accessible ones.
        served = accessible if self._remote_cache_accessible else True
        with self._lock:
            cache_id = next(self._next_id)
            self._add_to_engine(
                func, cache_id, cache_desc, addrs, is_blocks, served, blocks_model_id, cache_keys
            )
            cache = Cache(cache_id, cache_desc, list(addrs), self, True, is_blocks, accessible)
            self._caches[cache_id] = cache
        return cache

    def _add_to_engine(
        self,
        func: str,
        cache_id: int,
        cache_desc: CacheDesc,
        addrs: list[int],
        is_blocks: bool,
        served: bool,
        blocks_model_id: int,
        cache_keys: list[tuple[int, int, int]],
    ) -> None:
        status, message = self._engine.register_cache(
            cache_id,
            list(addrs),
            cache_desc.size,
            cache_desc.batch_size,
            is_blocks,
            served,
            blocks_model_id,
            cache_keys,
            writes_by_grant=self._writes_by_grant and is_blocks and served,
        )
        check_status(status, f"[{func}]", f"cache_desc = {cache_desc}: {message}")

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        check_isinstance("remote_accessible", remote_accessible, bool)
        model_id = -1
        if blocks_cache_key is not None:
            check_uint64("blocks_cache_key.cluster_id", blocks_cache_key.cluster_id)
            check_uint64("blocks_cache_key.model_id", blocks_cache_key.model_id)
            # Peers look a blocks cache up under (this engine's cluster id, model id), as in
            # LLM-DataDist: a key naming another cluster registers a cache no peer can find,
            # and never shadows this cluster's key.
            if to_int64(blocks_cache_key.cluster_id) == self._engine.cluster_id:
                model_id = to_int64(blocks_cache_key.model_id)
        return self._register(
            "register_blocks_cache", cache_desc, addrs, True, remote_accessible, model_id, []
        )

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        check_isinstance("cache_keys", cache_keys, (tuple, list), CacheKey, allow_none=False)
        check_isinstance("remote_accessible", remote_accessible, bool)
        keys = [
            (to_int64(k.req_id), to_int64(k.prefix_id), to_int64(k.model_id)) for k in cache_keys
        ]
        return self._register(
            "register_cache", cache_desc, addrs, False, remote_accessible, -1, keys
        )

    def unregister_cache(self, cache_id: int) -> None:
        self._check_is_inited()
        check_isinstance("cache_id", cache_id, int, allow_none=False)
        check_int64("cache_id", cache_id)
        with self._lock:
            raise_if_true(
                cache_id in self._pools.allocations,
                f"cache {cache_id} was allocated: release it with deallocate_cache",
            )
            status, message = self._engine.unregister_cache(cache_id)
            check_status(status, "[unregister_cache]", f"cache_id = {cache_id}: {message}")
            cache = self._caches.pop(cache_id, None)
        if cache is not None:
            cache._valid = False

    # --- pulls ----------------------------------------------------------------------------
    def _checked(self, call: Call, key: Any, cache: Any, **arguments: Any) -> Transfer:
        """The call's arguments through CANN's rules (``api.rules``), against this engine."""
        self._check_is_inited()
        return check(
            Transfer(
                call,
                key,
                cache,
                registered=self._caches,
                remote_cache_accessible=self._remote_cache_accessible,
                **arguments,
            )
        )

    def _validated_pull(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any,
        dst_blocks: Any,
        kwargs: dict[str, Any],
    ) -> PullArgs:
        transfer = self._checked(
            PULL_BLOCKS,
            src_cache_key,
            dst_cache,
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
            kwargs=kwargs,
        )
        return PullArgs.of(transfer)

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] | None = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        """Pull blocks of a linked peer's cache into local blocks (reference section 6.2)."""
        args = self._validated_pull(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        native = args.native_args(self._timeout_ms)
        status, message = self._issue(lambda: self._engine.pull(*native), args.remote_cluster_id)
        check_status(status, "[pull_blocks]", f"src_cache_key = {src_cache_key}: {message}")

    def _issue(self, pull: Callable[[], tuple[int, str]], remote: int) -> tuple[int, str]:
        """Without remote cache access CANN serves a pull from the owner's process, which finds
        a cache registered after the link: here a pull that misses refreshes the link's copy of
        the peer's table once and runs again."""
        status, message = pull()
        if status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST and not self._remote_cache_accessible:
            refreshed, _ = self._engine.refresh_peer_table(to_int64(remote), self._timeout_ms)
            if refreshed == 0:
                status, message = pull()
        return status, message

    def pull_blocks_batch_async(self, pulls: Sequence[BlocksPull]) -> PullHandle:
        """Project extension: the pulls one after another, each complete before the next
        begins, as one job on the engine's transfer pool (a same-host batch under 1 MiB is
        copied on this thread instead, before this returns), the first failure stopping the
        rest. What it is for: a guard word, blocks and the guard word again, read back to back
        without Python in between.

        Every pull's arguments are checked (and bad ones raised) before this returns;
        transfer failures surface from the handle's ``wait``/``poll`` as ``pull_blocks``
        raises them, and need no Python thread to finish."""
        status, handle, message = self._engine.submit_pull_batch(self._batch_args(pulls))
        check_status(status, "[pull_blocks_batch_async]", message)
        return PullHandle(
            self._engine, handle, "pull_blocks_batch_async", f"a batch of {len(pulls)} pulls"
        )

    def _batch_args(self, pulls: Sequence[BlocksPull]) -> list[tuple[Any, ...]]:
        args = [
            self._validated_pull(
                p.src_cache_key, p.dst_cache, p.src_blocks, p.dst_blocks, dict(p.kwargs)
            )
            for p in pulls
        ]
        return [a.native_args(self._timeout_ms) for a in args]

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """The peer's row (a ``CacheKey``'s, or ``CacheKeyByIdAndIndex``'s) into row
        ``batch_index`` of a local contiguous cache: ``size`` bytes of each tensor, or the
        whole local row (which must fit the peer's)."""
        transfer = self._checked(
            PULL_CACHE,
            cache_key,
            cache,
            batch_index=batch_index,
            size=size,
            kwargs=kwargs,
            own_cluster_id=self._engine.cluster_id,
        )
        row = PullArgs.of(transfer)
        native = row.native_args(self._timeout_ms)
        status, message = self._issue(
            lambda: self._engine.pull_cache(*native), row.remote_cluster_id
        )
        check_status(status, "[pull_cache]", f"cache_key = {cache_key}: {message}")
