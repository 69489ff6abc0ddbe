"""kv_probe against vLLM's real CPU kernels: a decode block rebuilt from prefill blocks with
the probed runs equals the block the kernel writes itself."""

from __future__ import annotations

import pytest
import torch
import vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from hixl_connector.connector.kv.probe import cpu_slice_runs
from hixl_connector.connector.mapping.block_slices import SLICE_ELEMENTS


def kernel_cache(
    key: torch.Tensor, value: torch.Tensor, block_size: int, head_size: int
) -> torch.Tensor:
    """``[blocks, 1 head, block_size, 2 * head_size]`` filled by vLLM's own kernel."""
    tokens = key.shape[0]
    blocks = tokens // block_size
    cache = torch.zeros(blocks, 1, block_size, 2 * head_size, dtype=key.dtype)
    k_cache, v_cache = cache.view(blocks, 1, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        k_cache,
        v_cache,
        torch.arange(tokens, dtype=torch.long),
        _get_attn_isa(key.dtype, block_size, head_size, "auto"),
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("p", "d"), [(32, 64), (32, 128), (64, 128), (32, 96)])
@pytest.mark.parametrize("head_size", [64, 128])
def test_probed_runs_rebuild_the_kernel_s_own_block(
    dtype: torch.dtype, p: int, d: int, head_size: int
) -> None:
    torch.manual_seed(p + d + head_size)
    key = torch.randn(d, 1, head_size).to(dtype)
    value = torch.randn(d, 1, head_size).to(dtype)
    src = kernel_cache(key, value, p, head_size).flatten()
    want = kernel_cache(key, value, d, head_size).flatten()
    unit = 2 * p * head_size
    rebuilt = torch.full_like(want, float("nan"))
    for run in cpu_slice_runs(dtype, head_size, p, d, "auto"):
        start = run.part * unit + run.src * SLICE_ELEMENTS
        end = run.dst * SLICE_ELEMENTS
        n = run.count * SLICE_ELEMENTS
        rebuilt[end : end + n] = src[start : start + n]
    assert torch.equal(rebuilt, want)


def test_a_quantized_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        cpu_slice_runs(torch.bfloat16, 64, 32, 64, "fp8")
