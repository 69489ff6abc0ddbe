"""state_layout over memory laid out as vLLM lays a hybrid state model's KV out on CPU: one
int8 buffer per layer slot, each an attention layer's blocks and, block by block, a state
layer's pages (conv state from byte 0, then ssm state, then padding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from hixl_connector.connector.kv.layout import describe_kv_caches
from hixl_connector.connector.kv.state_layout import state_layer_specs
from hixl_connector.connector.peers.handshake import describe_mismatch

NUM_BLOCKS = 8
HEADS, BLOCK_SIZE, HEAD_SIZE = 2, 16, 16
PAGE = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # bf16 K and V: 2048 bytes
CONV, SSM = (3, 64), (2, 8, 8)
STATE = 3 * 64 * 2 + 2 * 8 * 8 * 4  # bf16 conv, fp32 ssm: 896 bytes
REGIONS = 2


def hybrid(ssm_dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], KVCacheConfig, Any]:
    """vLLM's kv_caches and KV-cache config of two attention layers and two state layers in
    two shared buffers, and the buffer itself."""
    state = 3 * 64 * 2 + 2 * 8 * 8 * ssm_dtype.itemsize
    buffer = torch.zeros(REGIONS * NUM_BLOCKS * PAGE, dtype=torch.int8)
    kv_caches: dict[str, Any] = {}
    for region in range(REGIONS):
        start = region * NUM_BLOCKS * PAGE
        raw = buffer[start : start + NUM_BLOCKS * PAGE]
        kv_caches[f"a{region}"] = raw.view(torch.bfloat16).view(
            NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE
        )
        kv_caches[f"m{region}"] = torch.as_strided(
            buffer, (NUM_BLOCKS, 1, 1, state), (PAGE, state, state, 1), start
        )
    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=1024,
        shapes=(CONV, SSM),
        dtypes=(torch.bfloat16, ssm_dtype),
        page_size_padded=PAGE,
    )
    groups = [KVCacheGroupSpec(["a0", "a1"], attention), KVCacheGroupSpec(["m0", "m1"], mamba)]
    return kv_caches, KVCacheConfig(NUM_BLOCKS, [], groups), buffer


def describe(kv_caches: dict[str, Any], config: KVCacheConfig) -> Any:
    return describe_kv_caches(
        kv_caches,
        NUM_BLOCKS,
        HEADS,
        groups_share_buffers=True,
        state_specs=state_layer_specs(config),
    )


def test_the_state_is_registered_in_whole_units_over_the_attention_buffers() -> None:
    kv_caches, config, buffer = hybrid()
    layout = describe(kv_caches, config)
    state = layout.state
    assert state is not None
    assert layout.num_layers == REGIONS and layout.block_bytes == PAGE
    assert state.regions == layout.tensor_addrs
    assert state.page_bytes == PAGE and state.unit_bytes == 128  # gcd(2048, 896)
    assert state.group_units == ((1, STATE // 128),)
    # Block 3's state: its page's leading 7 units, never the padding or block 4.
    assert list(state.units(1, 3)) == list(range(3 * 16, 3 * 16 + 7))
    with pytest.raises(ValueError, match="group 0 holds no state"):
        state.units(0, 3)
    # The views the test controls write are the state's bytes of each block, in place.
    state.views[1][5] = 7
    region = NUM_BLOCKS * PAGE
    touched = (buffer.view(torch.uint8) == 7).nonzero().flatten()
    assert touched.tolist() == list(range(region + 5 * PAGE, region + 5 * PAGE + STATE))


def test_the_handshake_names_a_state_dtype_that_differs() -> None:
    ours = describe(*hybrid()[:2]).compatibility_fields(BLOCK_SIZE)
    theirs = describe(*hybrid(torch.bfloat16)[:2]).compatibility_fields(BLOCK_SIZE)
    mismatch = describe_mismatch(ours, theirs)
    assert "kv_state:" in mismatch and "torch.float32" in mismatch and "torch.bfloat16" in mismatch
    assert ours["kv_state_conv_layout"] in ("SD", "DS")
    # A model without state compares as before: no state fields.
    attention_only = {k: v for k, v in hybrid()[0].items() if k.startswith("a")}
    plain = describe_kv_caches(attention_only, NUM_BLOCKS, HEADS, groups_share_buffers=True)
    assert plain.state is None
    assert not any(k.startswith("kv_state") for k in plain.compatibility_fields(BLOCK_SIZE))


def test_a_state_the_engine_cannot_move_whole_is_refused() -> None:
    kv_caches, config, buffer = hybrid()
    # Pages of another size than the attention page.
    kv_caches["m1"] = torch.as_strided(buffer, (NUM_BLOCKS, 1, 1, STATE), (PAGE // 2, 1, 1, 1))
    with pytest.raises(ValueError, match="state layer m1: 896 bytes a block, 1024 apart"):
        describe(kv_caches, config)
    kv_caches, config, _ = hybrid()
    # A state in memory of its own, beside no attention layer.
    alone = torch.zeros(NUM_BLOCKS * PAGE, dtype=torch.int8)
    kv_caches["m0"] = torch.as_strided(alone, (NUM_BLOCKS, 1, 1, STATE), (PAGE, 1, 1, 1))
    with pytest.raises(ValueError, match="state layer m0 lies in no buffer of an attention"):
        describe(kv_caches, config)
