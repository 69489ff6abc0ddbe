"""CANN's ``CacheManager`` as its Python layer behaves, with the project's C++ engine where
CANN has its compiled layer.

The Python checks are CANN's, in CANN's order (reference table 6.3, rows 2-16): keyword
arguments are read with ``dict.get`` (a misspelt ``tensor_num_per_layer`` is ignored and the
default 2 applies), ``None`` passes the type checks, and an empty or reversed layer range means
all layers. What CANN decides in C++ (rows 17-27: ids, lengths, links, the peer's cache table)
the engine decides, raising the same codes; a reused ``BlocksCacheKey`` re-points to the
newest cache (last wins, section 6.1). The stand-in adds two documented C++ rules in Python:
the request buffer (row 22) and a destination that is not remote-accessible (row 25).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from .fabric import Memory, Table, memory_of, pull_refusal
from .llm_types import BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, Placement
from .recorder import record, record_pull_kwargs
from .status import (
    LLMException,
    LLMStatusCode,
    check_isinstance,
    check_uint,
    handle_llm_status,
    raise_if_false,
    raise_if_true,
)

REQUEST_LIMIT_BYTES = 2 * 1024 * 1024
REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE = 112 * 1024
REQUEST_HEADER_BYTES = 256  # the stand-in's guess; the connector keeps a far wider margin
REQUEST_ENTRY_BYTES = 16
DEFAULT_TENSOR_NUM_PER_LAYER = 2
KEY_TYPES = (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
# The engine's remote_kind: a blocks key, a cache id and index, a cache key.
KIND_BLOCKS, KIND_CACHE_ID, KIND_CACHE_KEY = 0, 1, 2

logger = logging.getLogger(__name__)

# Test control, not CANN: every pull_blocks waits this long before it moves anything (a
# slow device), so that a test can stop P or abort a request while a read is in the engine.
_pull_delay_s = [0.0]
_delayed_pulls = [0]  # how many pull_blocks calls began their delay


def set_pull_delay(seconds: float) -> None:
    _pull_delay_s[0] = seconds


def delayed_pulls() -> int:
    """How many ``pull_blocks`` calls have begun waiting out the pull delay (test control)."""
    return _delayed_pulls[0]


def int64(value: int) -> int:
    """A uint64 id as the engine's int64 (two's complement)."""
    return value - 2**64 if value >= 2**63 else value


def not_emulated(what: str) -> LLMException:
    return LLMException(
        f"{what} is not emulated by the llm_datadist stand-in",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    )


def _tensors_of(name: str, layer_range: Any, per_layer: int) -> tuple[int, int]:
    """CANN's conversion of a layer range to (first tensor, count), count -1 for all: type,
    step, start; an empty or reversed range means all layers."""
    check_isinstance(name, layer_range, range)
    if layer_range is None:
        return 0, -1
    raise_if_true(layer_range.step != 1, f"param check failed, {name} step must be 1.")
    if len(layer_range) == 0:
        return 0, -1
    raise_if_true(layer_range.start < 0, f"{name} is invalid, the start value is < 0")
    check_uint(name, layer_range.start, 32)
    check_uint(name, layer_range[-1], 32)
    return layer_range.start * per_layer, len(layer_range) * per_layer


class CacheManager:
    def __init__(
        self,
        engine: Any,
        accessible_mode: bool,
        timeout_ms: int,
        link_mode: str,
        pool_bytes: int,
        table: Table,
    ) -> None:
        self._engine = engine
        self._accessible_mode = accessible_mode
        self._timeout_ms = timeout_ms
        self._ids = itertools.count(1)
        self._accessible: dict[int, bool] = {}  # cache id -> remote-accessible
        # The fabric (fabric.py): the link mode, the device pool, each local cache's memory,
        # and each linked peer's blocks caches by model id, as learnt at the link.
        self.link_mode = link_mode
        self._pool_bytes = pool_bytes
        self.table = table
        self._memory: dict[int, Memory] = {}
        self.peers: dict[int, dict[int, Memory]] = {}
        # Documented C++/HIXL rule: memory registered after link_clusters is not remotely
        # accessible. (CANN's Python guard, which raises on remote_accessible=True, is armed
        # only by the ranktable ``link``, which the stand-in does not emulate.)
        self.linked = False

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        record("register_blocks_cache")
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, list, int)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        check_isinstance("remote_accessible", remote_accessible, bool)
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        # Peers find a blocks cache under (this engine's cluster id, model id).
        model_id = -1
        key = blocks_cache_key
        if key is not None and int64(key.cluster_id) == self._engine.cluster_id:
            model_id = int64(key.model_id)
        return self._register(
            "register_blocks_cache", cache_desc, addrs, True, model_id, [], remote_accessible
        )

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        record("register_cache")
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, list, int)
        check_isinstance("cache_keys", cache_keys, (list, tuple), CacheKey)
        keys = [(int64(k.req_id), int64(k.prefix_id), int64(k.model_id)) for k in cache_keys]
        return self._register(
            "register_cache", cache_desc, addrs, False, -1, keys, remote_accessible
        )

    def _register(
        self,
        func: str,
        desc: CacheDesc,
        addrs: list[int],
        is_blocks: bool,
        model_id: int,
        keys: list[tuple[int, int, int]],
        remote_accessible: bool | None,
    ) -> Cache:
        """Device memory is played by host memory: the engine serves either alike."""
        if remote_accessible is None:  # CANN: True for DEVICE, False for HOST memory
            remote_accessible = desc.placement == Placement.DEVICE
        if self.linked and remote_accessible:
            logger.warning(
                "stand-in: memory registered after link_clusters is not remote accessible"
            )
            remote_accessible = False
        # Without remote-accessible mode CANN serves every cache through its owner.
        served = remote_accessible if self._accessible_mode else True
        cache_id = next(self._ids)
        code, message = self._engine.register_cache(
            cache_id, list(addrs), desc.size, desc.batch_size, is_blocks, served, model_id, keys
        )
        handle_llm_status(code, func, f"cache_desc = {desc}: {message}")
        self._accessible[cache_id] = remote_accessible
        memory = memory_of(desc.placement == Placement.DEVICE, addrs, desc.size)
        self._memory[cache_id] = memory
        if is_blocks and model_id >= 0 and remote_accessible:
            self.table.add(model_id, memory)
        return Cache(cache_id, desc, list(addrs), is_blocks)

    def unregister_cache(self, cache_id: int) -> None:
        record("unregister_cache")
        check_isinstance("cache_id", cache_id, int)
        code, message = self._engine.unregister_cache(cache_id)
        handle_llm_status(code, "unregister_cache", message)
        self._accessible.pop(cache_id, None)
        self._memory.pop(cache_id, None)

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] | None = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        record("pull_blocks")
        record_pull_kwargs(tuple(sorted(kwargs)))
        per_layer = kwargs.get("tensor_num_per_layer", DEFAULT_TENSOR_NUM_PER_LAYER)
        check_isinstance("src_cache_key", src_cache_key, KEY_TYPES)
        check_isinstance("dst_cache", dst_cache, Cache)
        check_isinstance("src_blocks", src_blocks, (list, tuple), int)
        check_isinstance("dst_blocks", dst_blocks, (list, tuple), int)
        raise_if_false(
            dst_cache.is_blocks_cache, "param check failed, dst_cache should be blocks cache."
        )
        raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
        check_uint("tensor_num_per_layer", per_layer, 32)
        raise_if_false(per_layer > 0, "tensor_num_per_layer is invalid, should > 0")
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_blocks) > 0, "src_blocks can not be empty.")
        else:
            if isinstance(src_cache_key, CacheKey):
                valid = [
                    i for i in (src_cache_key.req_id, src_cache_key.prefix_id) if i != 2**64 - 1
                ]
                raise_if_false(len(valid) == 1, "exactly one of req_id and prefix_id is valid")
            raise_if_false(
                len(src_blocks) == 0,
                "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.",
            )
        if src_cache_key is None:  # CANN packs the key here
            raise AttributeError("'NoneType' object has no attribute 'cluster_id'")
        src_first, src_count = _tensors_of(
            "src_layer_range", kwargs.get("src_layer_range"), per_layer
        )
        dst_first, dst_count = _tensors_of(
            "dst_layer_range", kwargs.get("dst_layer_range"), per_layer
        )
        for name, ids in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
            if ids and (min(ids) < 0 or max(ids) > 2**64 - 1):  # the binding's uint64
                raise TypeError(f"{name} ids must fit uint64")
        self._check_request_size(dst_cache, src_blocks, dst_blocks)
        raise_if_true(
            self._accessible_mode and not self._accessible.get(dst_cache.cache_id, True),
            f"local cache {dst_cache.cache_id} is not remote accessible",
        )
        self._check_fabric(src_cache_key, dst_cache)
        if _pull_delay_s[0]:
            _delayed_pulls[0] += 1
        time.sleep(_pull_delay_s[0])  # the slow device itself: the fault, not a wait
        code, message = self._engine.pull(
            int64(src_cache_key.cluster_id),
            *self._remote(src_cache_key),
            dst_cache.cache_id,
            list(src_blocks),
            list(dst_blocks),
            src_first,
            src_count,
            dst_first,
            dst_count,
            self._timeout_ms,
        )
        handle_llm_status(code, "pull_blocks", f"src_cache_key = {src_cache_key}: {message}")

    def _check_fabric(self, src_cache_key: Any, dst_cache: Cache) -> None:
        """The link mode's rule for this pull's memories (fabric.py). Only blocks caches are
        known by key; a cache the peer did not have at the link fails in the engine."""
        if not isinstance(src_cache_key, BlocksCacheKey):
            return
        peer = self.peers.get(int64(src_cache_key.cluster_id), {})
        remote = peer.get(int64(src_cache_key.model_id))
        local = self._memory.get(dst_cache.cache_id)
        if remote is None or local is None:
            return
        refusal = pull_refusal(self.link_mode, remote, local, self._pool_bytes)
        if refusal is not None:
            code, reason = refusal
            raise LLMException(
                f"pull_blocks failed, error code is {code}, {reason}", status_code=code
            )

    @staticmethod
    def _remote(key: Any) -> tuple[int, int, int, int, int, int]:
        """(kind, model id, cache id, req id, prefix id, batch index) of the engine's pull."""
        if isinstance(key, BlocksCacheKey):
            return KIND_BLOCKS, int64(key.model_id), -1, -1, -1, 0
        if isinstance(key, CacheKeyByIdAndIndex):
            return KIND_CACHE_ID, 0, key.cache_id, -1, -1, key.batch_index
        return KIND_CACHE_KEY, int64(key.model_id), -1, int64(key.req_id), int64(key.prefix_id), 0

    def _check_request_size(self, dst_cache: Cache, src: Any, dst: Any) -> None:
        """CANN's row 22 (for equal, non-empty lists; the engine rejects the others)."""
        if len(src) != len(dst) or not src:
            return
        runs = sum(
            1
            for i in range(len(src))
            if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
        )
        size = REQUEST_HEADER_BYTES + REQUEST_ENTRY_BYTES * (
            dst_cache.cache_desc.num_tensors + 2 * runs
        )
        limit = REQUEST_LIMIT_BYTES if self._accessible_mode else REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE
        if size > limit:
            raise LLMException(
                f"pull_blocks failed, error code is {LLMStatusCode.LLM_PARAM_INVALID}, request "
                f"of {len(src)} blocks in {runs} runs needs {size} bytes > buffer {limit}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )

    def pull_cache(self, *args: Any, **kwargs: Any) -> None:
        raise not_emulated("pull_cache")

    def push_blocks(self, *args: Any, **kwargs: Any) -> None:
        raise not_emulated("push_blocks")

    def push_cache(self, *args: Any, **kwargs: Any) -> None:
        raise not_emulated("push_cache")

    def transfer_cache_async(self, *args: Any, **kwargs: Any) -> None:
        raise not_emulated("transfer_cache_async")

    def remap_registered_memory(self, *args: Any, **kwargs: Any) -> None:
        raise not_emulated("remap_registered_memory")
