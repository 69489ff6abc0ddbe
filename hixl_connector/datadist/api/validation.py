"""Argument checks of ``CacheManager.pull_blocks``, in the order CANN llm_datadist applies them
(reference table 6.3, rows 2-18). Pure: no engine, no I/O.

Where CANN silently accepts a mistake, these checks raise instead (README.md lists each case):
unknown keyword arguments (TypeError), empty or reversed layer ranges and ``None`` keys/caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hixl_connector.datadist.api.checks import (
    INT64_MAX,
    UINT64_MAX,
    check_isinstance,
    check_uint32,
    is_valid_id,
    to_int64,
)
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheKey,
    CacheKeyByIdAndIndex,
)
from hixl_connector.datadist.api.status import LLMStatusCode, raise_if_false, raise_if_true

PULL_BLOCKS_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")
DEFAULT_TENSOR_NUM_PER_LAYER = 2

# Values of the native engine's remote_kind argument.
KIND_BLOCKS = 0
KIND_CACHE_ID = 1
KIND_CACHE_KEY = 2


@dataclass(frozen=True)
class PullArgs:
    """A validated pull, in the form the native engine takes it."""

    remote_cluster_id: int
    remote_kind: int
    model_id: int
    cache_id: int
    req_id: int
    prefix_id: int
    batch_index: int
    dst_cache_id: int
    src_blocks: list[int] | tuple[int, ...]
    dst_blocks: list[int] | tuple[int, ...]
    src_tensor_first: int
    src_tensor_count: int
    dst_tensor_first: int
    dst_tensor_count: int

    def native_args(self, timeout_ms: int) -> tuple[Any, ...]:
        return (
            to_int64(self.remote_cluster_id),
            self.remote_kind,
            to_int64(self.model_id),
            self.cache_id,
            to_int64(self.req_id),
            to_int64(self.prefix_id),
            self.batch_index,
            self.dst_cache_id,
            self.src_blocks,
            self.dst_blocks,
            self.src_tensor_first,
            self.src_tensor_count,
            self.dst_tensor_first,
            self.dst_tensor_count,
            timeout_ms,
        )


def check_kwargs(func_name: str, kwargs: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"{func_name}() got unexpected keyword argument(s) {unknown}; "
            f"allowed keyword arguments are {list(allowed)}"
        )


def check_block_list(name: str, blocks: Any) -> None:
    if blocks is None:
        raise TypeError(f"{name} must be a list or tuple of int, but got None.")
    check_isinstance(name, blocks, (list, tuple), int)


def check_cache_key_ids(cache_key: CacheKey) -> None:
    req_valid = is_valid_id(cache_key.req_id)
    prefix_valid = is_valid_id(cache_key.prefix_id)
    raise_if_true(
        not req_valid and not prefix_valid,
        "one of req id and prefix id should contain valid value:[0, 2**64-1), "
        f"req id:{cache_key.req_id}, prefix id:{cache_key.prefix_id}.",
    )
    raise_if_true(
        req_valid and prefix_valid,
        "only one of req id and prefix id should contain valid value:[0, 2**64-1), "
        f"req id:{cache_key.req_id}, prefix id:{cache_key.prefix_id}.",
    )


def layer_range_to_tensors(
    name: str, layer_range: range | None, tensor_num_per_layer: int
) -> tuple[int, int]:
    """Layer ``l`` is tensors ``[l*N, (l+1)*N)``; returns (first tensor, count); count -1 = all."""
    if layer_range is None:
        return 0, -1
    raise_if_true(
        len(layer_range) == 0,
        f"{name} {layer_range} is empty or reversed; pass None to transfer all layers",
    )
    raise_if_true(
        layer_range.start < 0, f"{name} is invalid, the start value:{layer_range.start} is < 0"
    )
    check_uint32(name, layer_range.start)
    check_uint32(name, layer_range[-1])
    return layer_range.start * tensor_num_per_layer, len(layer_range) * tensor_num_per_layer


def check_block_ids(name: str, blocks: list[int] | tuple[int, ...]) -> None:
    # The CANN binding converts ids to uint64 and raises TypeError when it cannot.
    if blocks and (min(blocks) < 0 or max(blocks) > UINT64_MAX):
        raise TypeError(f"{name} ids must fit uint64, got range [{min(blocks)}, {max(blocks)}]")


def _check_local_dst(
    dst_cache: Cache,
    dst_blocks: list[int] | tuple[int, ...],
    src_blocks: list[int] | tuple[int, ...],
    is_blocks_key: bool,
    dst_first: int,
    dst_count: int,
    ranged: bool,
    tensor_num_per_layer: int,
) -> None:
    """Row 18: checks on the local destination cache (HOST blocks caches)."""
    num_blocks = dst_cache.cache_desc.batch_size
    if max(dst_blocks) >= num_blocks:
        bad = next(b for b in dst_blocks if b >= num_blocks)
        raise_if_true(
            True, f"dst block id {bad} out of range [0, {num_blocks}) of cache {dst_cache.cache_id}"
        )
    raise_if_true(
        is_blocks_key and len(src_blocks) != len(dst_blocks),
        f"src_blocks size {len(src_blocks)} != dst_blocks size {len(dst_blocks)}",
    )
    num_tensors = dst_cache.cache_desc.num_tensors
    if ranged:
        raise_if_false(
            num_tensors % tensor_num_per_layer == 0,
            f"tensor_num_per_layer ({tensor_num_per_layer}) must divide the number of tensors "
            f"of cache {dst_cache.cache_id} ({num_tensors})",
        )
    raise_if_true(
        dst_count != -1 and dst_first + dst_count > num_tensors,
        f"dst tensors [{dst_first}, {dst_first + dst_count}) out of range [0, {num_tensors}) of "
        f"cache {dst_cache.cache_id}",
    )


def validate_pull_blocks(
    src_cache_key: Any,
    dst_cache: Any,
    src_blocks: Any,
    dst_blocks: Any,
    kwargs: dict[str, Any],
    registered: dict[int, Cache],
) -> PullArgs:
    """Rows 2-18 of table 6.3. ``registered``: this process's live caches by id (row 17)."""
    check_kwargs("pull_blocks", kwargs, PULL_BLOCKS_KWARGS)
    src_layer_range = kwargs.get("src_layer_range")
    dst_layer_range = kwargs.get("dst_layer_range")
    tensor_num_per_layer = kwargs.get("tensor_num_per_layer", DEFAULT_TENSOR_NUM_PER_LAYER)
    key_types = (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
    check_isinstance("src_cache_key", src_cache_key, key_types, allow_none=False)
    check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
    check_block_list("src_blocks", src_blocks)
    check_block_list("dst_blocks", dst_blocks)
    raise_if_false(
        dst_cache.is_blocks_cache, "param check failed, dst_cache should be blocks cache."
    )
    raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
    check_uint32("tensor_num_per_layer", tensor_num_per_layer)
    raise_if_false(
        tensor_num_per_layer > 0,
        f"[pull_blocks] param check failed, tensor_num_per_layer ({tensor_num_per_layer}) is "
        f"invalid, should [1, {dst_cache.cache_desc.num_tensors}]",
    )
    is_blocks_key = isinstance(src_cache_key, BlocksCacheKey)
    if is_blocks_key:
        raise_if_false(len(src_blocks) > 0, "src_blocks can not be empty.")
    else:
        if isinstance(src_cache_key, CacheKey):
            check_cache_key_ids(src_cache_key)
        raise_if_false(
            len(src_blocks) == 0,
            "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.",
        )
    check_isinstance("src_layer_range", src_layer_range, range)
    check_isinstance("dst_layer_range", dst_layer_range, range)
    for name, layer_range in (
        ("src_layer_range", src_layer_range),
        ("dst_layer_range", dst_layer_range),
    ):
        raise_if_true(
            layer_range is not None and layer_range.step != 1,
            f"param check failed, {name} step must be 1.",
        )
    src_first, src_count = layer_range_to_tensors(
        "src_layer_range", src_layer_range, tensor_num_per_layer
    )
    dst_first, dst_count = layer_range_to_tensors(
        "dst_layer_range", dst_layer_range, tensor_num_per_layer
    )
    check_block_ids("src_blocks", src_blocks)
    check_block_ids("dst_blocks", dst_blocks)
    raise_if_false(
        registered.get(dst_cache.cache_id) is dst_cache,
        f"local cache {dst_cache.cache_id} does not exist (unregistered or from another engine)",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    raise_if_true(
        bool(src_blocks) and max(src_blocks) > INT64_MAX,
        f"src block id {max(src_blocks) if src_blocks else 0} is out of range of any cache",
    )
    ranged = src_layer_range is not None or dst_layer_range is not None
    _check_local_dst(
        dst_cache,
        dst_blocks,
        src_blocks,
        is_blocks_key,
        dst_first,
        dst_count,
        ranged,
        tensor_num_per_layer,
    )
    return _to_pull_args(
        src_cache_key, dst_cache, src_blocks, dst_blocks, src_first, src_count, dst_first, dst_count
    )


def _to_pull_args(
    key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
    dst_cache: Cache,
    src_blocks: list[int] | tuple[int, ...],
    dst_blocks: list[int] | tuple[int, ...],
    src_first: int,
    src_count: int,
    dst_first: int,
    dst_count: int,
) -> PullArgs:
    kind, model_id, cache_id, req_id, prefix_id, batch_index = KIND_BLOCKS, 0, -1, -1, -1, 0
    if isinstance(key, BlocksCacheKey):
        model_id = key.model_id
    elif isinstance(key, CacheKeyByIdAndIndex):
        kind, cache_id, batch_index = KIND_CACHE_ID, key.cache_id, key.batch_index
    else:
        kind, model_id, req_id, prefix_id = KIND_CACHE_KEY, key.model_id, key.req_id, key.prefix_id
    return PullArgs(
        remote_cluster_id=key.cluster_id,
        remote_kind=kind,
        model_id=model_id,
        cache_id=cache_id,
        req_id=req_id,
        prefix_id=prefix_id,
        batch_index=batch_index,
        dst_cache_id=dst_cache.cache_id,
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
        src_tensor_first=src_first,
        src_tensor_count=src_count,
        dst_tensor_first=dst_first,
        dst_tensor_count=dst_count,
    )


def push_layer_ranges(
    call: str, src_cache: Cache, tensor_num_per_layer: Any, src_range: Any, dst_range: Any
) -> tuple[range, range]:
    """The source and destination layers of a push (push_blocks, push_cache): CANN's
    check_layer_range for each, every layer where a range is None. Unlike pull_blocks, an
    empty range is refused, and both must hold as many layers."""
    check_uint32("tensor_num_per_layer", tensor_num_per_layer)
    num_tensors = src_cache.cache_desc.num_tensors
    raise_if_false(
        tensor_num_per_layer > 0,
        f"[{call}] param check failed, tensor_num_per_layer ({tensor_num_per_layer}) is "
        f"invalid, should [1, {num_tensors}]",
    )
    every_layer = range(num_tensors // tensor_num_per_layer)
    src_layers = _push_layers("src_layer_range", src_range, every_layer)
    dst_layers = _push_layers("dst_layer_range", dst_range, every_layer)
    raise_if_false(
        len(src_layers) == len(dst_layers),
        f"src_layer_range {src_layers} and dst_layer_range {dst_layers} differ in length",
    )
    return src_layers, dst_layers


def _push_layers(name: str, layer_range: Any, default: range) -> range:
    check_isinstance(name, layer_range, range)
    chosen = default if layer_range is None else layer_range
    raise_if_true(chosen.step != 1, f"param check failed, {name} step must be 1.")
    raise_if_true(chosen.start < 0, f"{name} is invalid, the start value:{chosen.start} is < 0")
    raise_if_true(len(chosen) == 0, f"{name} {chosen} is empty")
    check_uint32(name, chosen.start)
    check_uint32(name, chosen[-1])
    return chosen
