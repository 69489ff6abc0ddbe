"""Where vLLM's CPU attention kernels put each key and value element inside a block.

Found by running the kernels, not assumed: the layout of a block's KV head depends on the
instruction set and on the block size (keys transposed for the vector kernels, packed in
pairs for AMX). The probe writes digits that identify (key or value, token, dimension) into
two small caches, one of P's block size and one of D's, with vLLM's own
``cpu_attn_reshape_and_cache``, reads back where each element landed, and turns the
correspondence into ``SliceRun``s (``block_slices.merge_runs``). Worker side only (torch).
"""

from __future__ import annotations

from typing import Any

from hixl_connector.connector.mapping.block_slices import SliceRun, merge_runs

# Digits small enough for every unquantized KV dtype to hold exactly (bf16: up to 256).
_BASE = 64
_QUANTIZED_PREFIXES = ("fp8",)


def cpu_slice_runs(
    dtype: Any, head_size: int, src_block_size: int, dst_block_size: int, kv_cache_dtype: str
) -> tuple[SliceRun, ...]:
    """Runs that rebuild one KV head of a ``dst_block_size`` block from the same head of
    ``dst_block_size // src_block_size`` consecutive ``src_block_size`` blocks.

    Raises ValueError when the layout does not allow it (quantized caches, or a kernel that
    does not move whole slices)."""
    if kv_cache_dtype.startswith(_QUANTIZED_PREFIXES):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r}: prefill and decode block sizes must be equal "
            "for a quantized KV cache"
        )
    ratio = dst_block_size // src_block_size
    src = _element_keys(dtype, head_size, src_block_size, ratio, kv_cache_dtype)
    dst = _element_keys(dtype, head_size, dst_block_size, 1, kv_cache_dtype)
    unit = 2 * src_block_size * head_size
    where = {key: index for index, key in enumerate(src)}
    if len(where) != len(src) or set(where) != set(dst):
        raise ValueError(
            f"the CPU KV layout of block size {dst_block_size} does not hold the same elements "
            f"as {ratio} blocks of {src_block_size}"
        )
    origins = [divmod(where[key], unit) for key in dst]
    return merge_runs(origins, unit, ratio)


def _element_keys(
    dtype: Any, head_size: int, block_size: int, blocks: int, kv_cache_dtype: str
) -> list[tuple[int, int, int]]:
    """(0 for key / 1 for value, token, dimension) of every element of ``blocks`` consecutive
    blocks of one KV head, in memory order, as the kernel for this block size writes them."""
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    tokens = blocks * block_size
    if tokens > _BASE * _BASE or head_size > _BASE * _BASE:
        raise ValueError(f"block size {block_size} x {blocks} is too large to probe")
    token = torch.arange(tokens).view(tokens, 1, 1).expand(tokens, 1, head_size)
    dim = torch.arange(head_size).view(1, 1, head_size).expand(tokens, 1, head_size)
    digits = []
    for field in (token % _BASE, token // _BASE, dim % _BASE, dim // _BASE):
        cache = torch.zeros(blocks, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(blocks, 1, 2 * block_size, head_size).chunk(2, dim=2)
        written = (field + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(
            written,
            -written,
            key_cache,
            value_cache,
            torch.arange(tokens, dtype=torch.long),
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype=kv_cache_dtype,
        )
        digits.append(cache.flatten().to(torch.float32))
    if bool((digits[0] == 0).any()):
        raise ValueError(f"the CPU kernel ({isa}) leaves parts of a {block_size}-token block")
    is_value = (digits[0] < 0).to(torch.long)
    low_t, high_t, low_d, high_d = ((d.abs() - 1).to(torch.long) for d in digits)
    keys = torch.stack([is_value, low_t + _BASE * high_t, low_d + _BASE * high_d], dim=1)
    return [tuple(row) for row in keys.tolist()]
