"""CANN's ``CacheManager`` as its Python layer behaves, over the project's native engine.

The Python checks are CANN's, in CANN's order (reference table 6.3, rows 2-15): keyword
arguments are read with ``dict.get`` (a misspelt ``tensor_num_per_layer`` is ignored and the
default 2 applies), ``None`` passes the type checks, and an empty or reversed layer range means
all layers. What CANN decides in C++ (address counts, list lengths, id ranges, links) is left
to the native engine, which raises the same ``LLMException`` codes and, like CANN, re-points a
reused ``BlocksCacheKey`` to the newest cache (last wins, section 6.1); the stand-in adds the
one documented C++ rule the engine lacks, the request buffer (row 22).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hixl_connector.datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LLMException,
    LLMStatusCode,
    Placement,
)
from hixl_connector.datadist.checks import check_isinstance, check_uint32
from hixl_connector.datadist.status import raise_if_false, raise_if_true
from hixl_connector.datadist.validation import check_cache_key_ids

from .recorder import record, record_pull_kwargs

REQUEST_LIMIT_BYTES = 2 * 1024 * 1024
REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE = 112 * 1024
REQUEST_HEADER_BYTES = 256  # the stand-in's guess; the connector keeps a far wider margin
REQUEST_ENTRY_BYTES = 16
DEFAULT_TENSOR_NUM_PER_LAYER = 2
KEY_TYPES = (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)

logger = logging.getLogger(__name__)

# Test control, not CANN: every pull_blocks waits this long before it moves anything (a
# slow device), so that a test can stop P or abort a request while a read is in the engine.
_pull_delay_s = [0.0]


def set_pull_delay(seconds: float) -> None:
    _pull_delay_s[0] = seconds


def _not_emulated(what: str) -> LLMException:
    return LLMException(
        f"{what} is not emulated by the llm_datadist stand-in",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    )


def _as_host(desc: Any) -> Any:
    """Device memory is played by host memory."""
    if not isinstance(desc, CacheDesc) or desc.placement == Placement.HOST:
        return desc
    return CacheDesc(
        desc.num_tensors, list(desc.shape), desc.data_type, Placement.HOST, desc.batch_dim
    )


def _check_layer_range(name: str, layer_range: Any) -> range | None:
    """CANN's conversion of a layer range: type, step, start; empty or reversed means all
    layers, so the native engine gets ``None`` for it."""
    check_isinstance(name, layer_range, range)
    if layer_range is None:
        return None
    raise_if_true(layer_range.step != 1, f"param check failed, {name} step must be 1.")
    if len(layer_range) == 0:
        return None
    raise_if_true(layer_range.start < 0, f"{name} is invalid, the start value is < 0")
    check_uint32(name, layer_range.start)
    check_uint32(name, layer_range[-1])
    return layer_range


class CacheManager:
    def __init__(self, native: Any, accessible_mode: bool) -> None:
        self._native = native
        self._accessible_mode = accessible_mode
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
        accessible = self._accessible(cache_desc, remote_accessible)
        # A reused key re-points to the newest cache (last wins), in the engine as in CANN.
        return self._native.register_blocks_cache(
            _as_host(cache_desc), addrs, blocks_cache_key, accessible
        )

    def _accessible(self, cache_desc: Any, remote_accessible: bool | None) -> bool | None:
        if isinstance(cache_desc, CacheDesc) and remote_accessible is None:
            remote_accessible = cache_desc.placement == Placement.DEVICE
        if self.linked and remote_accessible:
            logger.warning(
                "stand-in: memory registered after link_clusters is not remote accessible"
            )
            return False
        return remote_accessible

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        record("register_cache")
        accessible = self._accessible(cache_desc, remote_accessible)
        return self._native.register_cache(_as_host(cache_desc), addrs, cache_keys, accessible)

    def unregister_cache(self, cache_id: int) -> None:
        record("unregister_cache")
        self._native.unregister_cache(cache_id)

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
        tensor_num_per_layer = kwargs.get("tensor_num_per_layer", DEFAULT_TENSOR_NUM_PER_LAYER)
        check_isinstance("src_cache_key", src_cache_key, KEY_TYPES)
        check_isinstance("dst_cache", dst_cache, Cache)
        check_isinstance("src_blocks", src_blocks, (list, tuple), int)
        check_isinstance("dst_blocks", dst_blocks, (list, tuple), int)
        raise_if_false(
            dst_cache.is_blocks_cache, "param check failed, dst_cache should be blocks cache."
        )
        raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        raise_if_false(tensor_num_per_layer > 0, "tensor_num_per_layer is invalid, should > 0")
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_blocks) > 0, "src_blocks can not be empty.")
        else:
            if isinstance(src_cache_key, CacheKey):
                check_cache_key_ids(src_cache_key)
            raise_if_false(
                len(src_blocks) == 0,
                "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.",
            )
        if src_cache_key is None:  # CANN packs the key here
            raise AttributeError("'NoneType' object has no attribute 'cluster_id'")
        native_kwargs: dict[str, Any] = {"tensor_num_per_layer": tensor_num_per_layer}
        for name in ("src_layer_range", "dst_layer_range"):
            layer_range = _check_layer_range(name, kwargs.get(name))
            if layer_range is not None:
                native_kwargs[name] = layer_range
        self._check_request_size(dst_cache, src_blocks, dst_blocks)
        time.sleep(_pull_delay_s[0])
        self._native.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, **native_kwargs)

    def _check_request_size(self, dst_cache: Cache, src: Any, dst: Any) -> None:
        """CANN's row 22 (for equal, non-empty lists; the engine rejects the others)."""
        if len(src) != len(dst) or not src:
            return
        runs = _runs(src, dst)
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
        raise _not_emulated("pull_cache")

    def push_blocks(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("push_blocks")

    def push_cache(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("push_cache")

    def transfer_cache_async(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("transfer_cache_async")

    def remap_registered_memory(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("remap_registered_memory")


def _runs(src: Any, dst: Any) -> int:
    """How many runs of pairs consecutive on both sides CANN sizes a request by."""
    return sum(
        1 for i in range(len(src)) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
    )
