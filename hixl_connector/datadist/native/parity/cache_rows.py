"""Argument checks of the row transfers between contiguous caches, ``pull_cache`` and
``push_cache``, in CANN's order (reference section 6.5). Pure: no engine, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hixl_connector.datadist.api.checks import (
    check_int64,
    check_isinstance,
    check_uint32,
    to_int64,
)
from hixl_connector.datadist.api.llm_types import Cache, CacheKey, CacheKeyByIdAndIndex
from hixl_connector.datadist.api.status import LLMStatusCode, raise_if_false, raise_if_true
from hixl_connector.datadist.api.validation import (
    DEFAULT_TENSOR_NUM_PER_LAYER,
    KIND_CACHE_ID,
    KIND_CACHE_KEY,
    PULL_BLOCKS_KWARGS,
    check_cache_key_ids,
    check_kwargs,
    layer_range_to_tensors,
    push_layer_ranges,
)


@dataclass(frozen=True)
class RowTransfer:
    """A validated row transfer: the peer's row (by key, or cache id and batch index) and
    the local row, with the tensor ranges of both sides."""

    remote_cluster_id: int
    remote_kind: int
    model_id: int
    cache_id: int
    req_id: int
    prefix_id: int
    remote_batch_index: int
    local_cache_id: int
    local_batch_index: int
    size: int
    remote_first: int
    remote_count: int
    local_first: int
    local_count: int

    def pull_args(self, timeout_ms: int) -> tuple[Any, ...]:
        return (
            to_int64(self.remote_cluster_id),
            self.remote_kind,
            to_int64(self.model_id),
            self.cache_id,
            to_int64(self.req_id),
            to_int64(self.prefix_id),
            self.remote_batch_index,
            self.local_cache_id,
            self.local_batch_index,
            self.size,
            self.remote_first,
            self.remote_count,
            self.local_first,
            self.local_count,
            timeout_ms,
        )

    def push_args(self, timeout_ms: int) -> tuple[Any, ...]:
        return (
            to_int64(self.remote_cluster_id),
            -1,
            self.local_cache_id,
            (),
            (),
            self.local_first,
            self.local_count,
            self.remote_first,
            self.remote_count,
            timeout_ms,
            KIND_CACHE_ID,
            self.cache_id,
            self.remote_batch_index,
            self.local_batch_index,
        )


def _check_registered(cache: Cache, registered: dict[int, Cache]) -> None:
    raise_if_false(
        registered.get(cache.cache_id) is cache,
        f"local cache {cache.cache_id} does not exist (unregistered or from another engine)",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )


def validate_pull_cache(
    cache_key: Any,
    cache: Any,
    batch_index: Any,
    size: Any,
    kwargs: dict[str, Any],
    remote_cache_accessible: bool,
    own_cluster_id: int,
    registered: dict[int, Cache],
) -> RowTransfer:
    check_kwargs("pull_cache", kwargs, PULL_BLOCKS_KWARGS)
    key_types = (
        (CacheKeyByIdAndIndex,) if remote_cache_accessible else (CacheKey, CacheKeyByIdAndIndex)
    )
    check_isinstance("cache_key", cache_key, key_types, allow_none=False)
    check_isinstance("cache", cache, Cache, allow_none=False)
    check_uint32("batch_index", batch_index)
    check_int64("size", size)
    raise_if_true(cache.is_blocks_cache, "param check failed, cache can not be blocks cache.")
    raise_if_false(
        size == -1 or size > 0, f"[pull_cache] param check failed, size ({size}) is invalid"
    )
    n = kwargs.get("tensor_num_per_layer", DEFAULT_TENSOR_NUM_PER_LAYER)
    check_uint32("tensor_num_per_layer", n)
    raise_if_false(n > 0, "tensor_num_per_layer should be > 0")
    if isinstance(cache_key, CacheKey):
        check_cache_key_ids(cache_key)
    for name in ("src_layer_range", "dst_layer_range"):
        check_isinstance(name, kwargs.get(name), range)
        layers = kwargs.get(name)
        raise_if_true(
            layers is not None and layers.step != 1, f"param check failed, {name} step must be 1."
        )
    src_first, src_count = layer_range_to_tensors(
        "src_layer_range", kwargs.get("src_layer_range"), n
    )
    dst_first, dst_count = layer_range_to_tensors(
        "dst_layer_range", kwargs.get("dst_layer_range"), n
    )
    raise_if_true(cache_key.cluster_id == own_cluster_id, "data can not be pulled from own cluster")
    _check_registered(cache, registered)
    raise_if_true(
        remote_cache_accessible and not cache._remote_accessible,
        f"local cache {cache.cache_id} is not remote accessible; register it with "
        "remote_accessible=True when enable_remote_cache_accessible is on",
    )
    by_key = isinstance(cache_key, CacheKey)
    return RowTransfer(
        remote_cluster_id=cache_key.cluster_id,
        remote_kind=KIND_CACHE_KEY if by_key else KIND_CACHE_ID,
        model_id=cache_key.model_id if by_key else 0,
        cache_id=-1 if by_key else cache_key.cache_id,
        req_id=cache_key.req_id if by_key else -1,
        prefix_id=cache_key.prefix_id if by_key else -1,
        remote_batch_index=0 if by_key else cache_key.batch_index,
        local_cache_id=cache.cache_id,
        local_batch_index=batch_index,
        size=size,
        remote_first=src_first,
        remote_count=src_count,
        local_first=dst_first,
        local_count=dst_count,
    )


def validate_push_cache(
    dst_cache_key: Any,
    src_cache: Any,
    src_batch_index: Any,
    src_layer_range: Any,
    dst_layer_range: Any,
    size: Any,
    tensor_num_per_layer: Any,
    registered: dict[int, Cache],
) -> RowTransfer:
    check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
    check_isinstance("src_cache", src_cache, Cache, allow_none=False)
    check_uint32("src_batch_index", src_batch_index)
    raise_if_true(
        src_cache.is_blocks_cache, "param check failed, src_cache can not be blocks cache."
    )
    src_layers, dst_layers = push_layer_ranges(
        "push_cache", src_cache, tensor_num_per_layer, src_layer_range, dst_layer_range
    )
    check_int64("size", size)
    raise_if_false(size == -1, f"size ({size}) must be -1: a push moves the whole row")
    _check_registered(src_cache, registered)
    raise_if_false(
        src_batch_index < src_cache.cache_desc.batch_size,
        f"src_batch_index {src_batch_index} is outside batch size "
        f"{src_cache.cache_desc.batch_size} of cache {src_cache.cache_id}",
    )
    num_tensors = src_cache.cache_desc.num_tensors
    count = len(src_layers) * tensor_num_per_layer
    raise_if_true(
        src_layers.start * tensor_num_per_layer + count > num_tensors,
        f"src_layer_range {src_layers} is out of range of cache {src_cache.cache_id}",
    )
    return RowTransfer(
        remote_cluster_id=dst_cache_key.cluster_id,
        remote_kind=KIND_CACHE_ID,
        model_id=0,
        cache_id=dst_cache_key.cache_id,
        req_id=-1,
        prefix_id=-1,
        remote_batch_index=dst_cache_key.batch_index,
        local_cache_id=src_cache.cache_id,
        local_batch_index=src_batch_index,
        size=-1,
        remote_first=dst_layers.start * tensor_num_per_layer,
        remote_count=count,
        local_first=src_layers.start * tensor_num_per_layer,
        local_count=count,
    )
