"""Copies inside this process of the LLM-DataDist v2 API: ``copy_cache``, ``copy_blocks`` and
``swap_blocks``. Planning is pure (which byte ranges move, checked against the caches'
descriptors, CANN's checks in its order); ``run`` moves them with ``memmove``."""

from __future__ import annotations

import ctypes
from typing import Any

from hixl_connector.datadist.api.c_types import (
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
)
from hixl_connector.datadist.api.llm_types import Cache, Placement
from hixl_connector.datadist.api.status import LLMStatusCode, raise_if_false, raise_if_true

# (destination address, source address, bytes)
Copy = tuple[int, int, int]


def stride(cache: Cache) -> int:
    """Bytes of one batch row (contiguous cache) or one block (blocks cache) of a tensor."""
    return int(cache.cache_desc.size // cache.cache_desc.batch_size)


def plan_copy_cache(
    dst: Any,
    src: Any,
    dst_batch_index: Any,
    src_batch_index: Any,
    offset: Any,
    size: Any,
) -> list[Copy]:
    check_isinstance("dst", dst, Cache, allow_none=False)
    check_isinstance("src", src, Cache, allow_none=False)
    check_uint32("dst_batch_index", dst_batch_index)
    check_uint32("src_batch_index", src_batch_index)
    check_uint64("offset", offset)
    check_int64("size", size)
    raise_if_true(src.is_blocks_cache, "src cache can not be blocks cache.")
    raise_if_true(dst.is_blocks_cache, "dst cache can not be blocks cache.")
    raise_if_false(size == -1 or size > 0, f"size ({size}) is invalid")
    raise_if_false(
        dst.cache_desc.num_tensors == src.cache_desc.num_tensors,
        f"num_tensors differ: dst {dst.cache_desc.num_tensors}, src {src.cache_desc.num_tensors}",
    )
    for name, cache, index in (("dst", dst, dst_batch_index), ("src", src, src_batch_index)):
        raise_if_false(
            index < cache.cache_desc.batch_size,
            f"{name}_batch_index {index} is outside batch size {cache.cache_desc.batch_size}",
        )
    dst_stride, src_stride = stride(dst), stride(src)
    raise_if_true(
        offset > 0 and (offset >= dst_stride or offset >= src_stride),
        f"offset {offset} is outside a row (dst {dst_stride} B, src {src_stride} B)",
    )
    nbytes = size if size != -1 else src_stride - offset
    raise_if_true(
        nbytes > dst_stride - offset or nbytes > src_stride - offset,
        f"{nbytes} bytes from offset {offset} do not fit a row (dst {dst_stride} B, "
        f"src {src_stride} B)",
    )
    return [
        (
            d + dst_stride * dst_batch_index + offset,
            s + src_stride * src_batch_index + offset,
            nbytes,
        )
        for d, s in zip(dst.tensor_addrs, src.tensor_addrs, strict=True)
    ]


def plan_copy_blocks(cache: Any, copy_block_info: Any) -> list[Copy]:
    """``copy_block_info``: ``{src_block: [dst_block, ...]}`` inside one blocks cache."""
    check_isinstance("cache", cache, Cache, allow_none=False)
    check_isinstance("copy_block_info", copy_block_info, dict, int, allow_none=False)
    for targets in copy_block_info.values():
        check_isinstance("copy_block_info value", targets, list, int, allow_none=False)
    raise_if_false(cache.is_blocks_cache, "cache must be a blocks cache")
    blocks, block_bytes = cache.cache_desc.batch_size, stride(cache)
    pairs = [(s, d) for s, targets in copy_block_info.items() for d in targets]
    for s, d in pairs:
        raise_if_false(
            0 <= s < blocks and 0 <= d < blocks,
            f"block pair ({s}, {d}) is outside [0, {blocks}) of cache {cache.cache_id}",
        )
    return [
        (base + d * block_bytes, base + s * block_bytes, block_bytes)
        for base in cache.tensor_addrs
        for s, d in pairs
    ]


def plan_swap_blocks(src: Any, dst: Any, src_to_dst: Any) -> list[Copy]:
    """Blocks between a device cache and a host one (either way), by address: a cache from
    ``Cache.create_cpu_cache`` need not be registered."""
    check_isinstance("src_cache", src, Cache, allow_none=False)
    check_isinstance("dst_cache", dst, Cache, allow_none=False)
    raise_if_false(src.is_blocks_cache and dst.is_blocks_cache, "caches must be blocks caches")
    check_isinstance("src_to_dst", src_to_dst, dict, int, allow_none=False)
    block_bytes = stride(src)
    raise_if_false(
        block_bytes == stride(dst), f"block sizes differ: src {block_bytes}, dst {stride(dst)}"
    )
    raise_if_false(
        src.cache_desc.num_tensors == dst.cache_desc.num_tensors,
        f"num_tensors differ: src {src.cache_desc.num_tensors}, dst {dst.cache_desc.num_tensors}",
    )
    for s, d in src_to_dst.items():
        check_isinstance("src_to_dst value", d, int, allow_none=False)
        raise_if_false(
            0 <= s < src.cache_desc.batch_size and 0 <= d < dst.cache_desc.batch_size,
            f"block pair ({s}, {d}) is outside the caches",
        )
    placements = (src.cache_desc.placement, dst.cache_desc.placement)
    raise_if_false(
        placements in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)),
        f"swap_blocks moves between HOST and DEVICE caches, not {placements[0].name} to "
        f"{placements[1].name}",
    )
    return [
        (d_base + d * block_bytes, s_base + s * block_bytes, block_bytes)
        for s_base, d_base in zip(src.tensor_addrs, dst.tensor_addrs, strict=True)
        for s, d in src_to_dst.items()
    ]


def check_registered(cache: Cache, registered: dict[int, Cache]) -> None:
    raise_if_false(
        registered.get(cache.cache_id) is cache,
        f"cache {cache.cache_id} does not exist (unregistered or from another engine)",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )


def run(copies: list[Copy]) -> None:
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)
