"""state_layout over memory laid out as vllm-ascend (0.16 and later) lays a hybrid state
model's KV out: one int8 buffer per layer slot of N blocks, cut in planes: every block's conv
state from byte 0, then every block's ssm state, which are the same bytes as the attention
layers' K (the page-size rule makes a K block as large as an ssm state), then V."""

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

from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.state_layout import state_layer_specs
from hixl_connector.connector.mapping.state_groups import (
    StatePart,
    parts_by_group,
    placed_units,
    state_length,
)
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.push.registration import PushRegistration, StateRun
from hixl_connector.connector.push.request_push import state_pairs
from hixl_connector.connector.worker.announcement import state_parts

HEADS, BLOCK_SIZE, HEAD_SIZE = 2, 16, 16
CONV, SSM = (3, 64), (2, 8, 16)
CONV_BYTES = 3 * 64 * 2  # bf16: 384
SSM_BYTES = 2 * 8 * 16 * 4  # fp32: 1024, a bf16 K block of 16 tokens x 2 heads x 16
PAGE = CONV_BYTES + 2 * SSM_BYTES  # vllm-ascend's page: conv, K (= ssm), V
REGIONS = 2


def planes(num_blocks: int) -> tuple[KVLayout, dict[str, Any], Any]:
    """vllm-ascend's kv_caches of two attention layers and two state layers over two buffers
    of ``num_blocks`` blocks, described: (the layout, the caches, the buffers' memory)."""
    memory = torch.zeros(REGIONS * num_blocks * PAGE, dtype=torch.int8)
    kv_caches: dict[str, Any] = {}
    n = num_blocks
    for region in range(REGIONS):
        raw = memory[region * n * PAGE : (region + 1) * n * PAGE]
        ssm_plane = raw[n * CONV_BYTES : n * (CONV_BYTES + SSM_BYTES)]
        k = ssm_plane.view(torch.bfloat16).view(n, BLOCK_SIZE, HEADS, HEAD_SIZE)
        v = raw[n * (CONV_BYTES + SSM_BYTES) :].view(torch.bfloat16).view(k.shape)
        kv_caches[f"a{region}"] = (k, v)
        conv = raw[: n * CONV_BYTES].view(torch.bfloat16).view(n, *CONV)
        kv_caches[f"m{region}"] = [conv, ssm_plane.view(torch.float32).view(n, *SSM)]
    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=1024,
        shapes=(CONV, SSM),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE,
    )
    groups = [KVCacheGroupSpec(["a0", "a1"], attention), KVCacheGroupSpec(["m0", "m1"], mamba)]
    config = KVCacheConfig(n, [], groups)
    layout = describe_kv_caches(
        kv_caches, n, groups_share_buffers=True, state_specs=state_layer_specs(config)
    )
    return layout, kv_caches, memory


def test_the_states_are_registered_from_each_buffers_first_byte_in_two_planes() -> None:
    n = 8
    layout, kv_caches, memory = planes(n)
    state = layout.state
    assert state is not None
    unit = 128  # gcd(384, 1024)
    assert state.unit_bytes == unit
    # The whole buffer, from the conv plane's first byte (2 MB aligned on the NPU, where K
    # and V are not): the KV is read through it too.
    assert state.regions == tuple(memory.data_ptr() + r * n * PAGE for r in range(REGIONS))
    assert state.region_units == n * PAGE // unit
    conv_units, ssm_units = CONV_BYTES // unit, SSM_BYTES // unit
    parts = (StatePart(0, conv_units, conv_units), StatePart(n * conv_units, ssm_units, ssm_units))
    assert state.group_parts == ((1, parts),)
    assert state.units(1, 5) == [
        *range(5 * conv_units, 6 * conv_units),
        *range(n * conv_units + 5 * ssm_units, n * conv_units + 6 * ssm_units),
    ]
    # An attention block's K (the ssm plane's bytes) and V, in the same registration.
    assert layout.kv_in_states_buffers and layout.tensors_per_layer == 2
    assert state.kv_parts == (
        StatePart(n * conv_units, ssm_units, ssm_units),
        StatePart(n * (conv_units + ssm_units), ssm_units, ssm_units),
    )
    assert layout.tensor_addrs == tuple(
        t.data_ptr() for r in range(REGIONS) for t in kv_caches[f"a{r}"]
    )
    # The handshake's rows give D the same parts.
    assert parts_by_group(state_parts(state)) == dict(state.group_parts)
    # The controls' views: each part's bytes of a block, in place.
    for view in state.views:
        view[5] = 7
    touched = (memory.view(torch.uint8) == 7).nonzero().flatten().tolist()
    expected = []
    for region in range(REGIONS):
        raw = region * n * PAGE
        expected += range(raw + 5 * CONV_BYTES, raw + 6 * CONV_BYTES)
        ssm = raw + n * CONV_BYTES + 5 * SSM_BYTES
        expected += range(ssm, ssm + SSM_BYTES)
    assert touched == sorted(expected)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_state_moves_between_engines_of_other_block_counts_and_nothing_else_changes(
    mode: str,
) -> None:
    """P of 8 blocks, D of 12: P's state of block 3 lands as D's state of block 5 (its conv,
    its ssm, so its K of block 5), read by D or written by P from the runs D registers."""
    p_layout, p_caches, p_memory = planes(8)
    d_layout, d_caches, d_memory = planes(12)
    assert p_layout.state is not None and d_layout.state is not None
    fields = p_layout.compatibility_fields(BLOCK_SIZE)
    assert fields == d_layout.compatibility_fields(BLOCK_SIZE)
    p_memory.copy_(torch.randint(-128, 128, p_memory.shape, dtype=torch.int8))
    before = d_memory.clone()
    moved = moved_units(mode, p_layout, d_layout)
    assert set(moved) == {0}
    copy_units(p_layout, p_memory, d_layout, d_memory, *moved[0])
    for region in range(REGIONS):
        p_conv, p_ssm = p_caches[f"m{region}"]
        d_conv, d_ssm = d_caches[f"m{region}"]
        # Bytes, not values: random bytes are NaNs here and there.
        assert same_bytes(d_conv[5], p_conv[3]) and same_bytes(d_ssm[5], p_ssm[3])
        assert same_bytes(d_caches[f"a{region}"][0][5], p_caches[f"a{region}"][0][3])
    changed = (d_memory != before).nonzero().flatten().tolist()
    n = 12
    allowed = set()
    for region in range(REGIONS):
        raw = region * n * PAGE
        allowed |= set(range(raw + 5 * CONV_BYTES, raw + 6 * CONV_BYTES))
        ssm = raw + n * CONV_BYTES + 5 * SSM_BYTES
        allowed |= set(range(ssm, ssm + SSM_BYTES))
    assert changed and set(changed) <= allowed


def test_kv_blocks_move_through_the_states_registration_between_block_counts() -> None:
    """P of 8 blocks, D of 12: P's K and V of blocks 1 and 2 land as D's of blocks 6 and 7, as
    D maps them through each side's KV parts (read_units.kv_beside_states), and nothing else:
    no conv state, no other block (K of a block is its ssm state: the same bytes)."""
    p_layout, p_caches, p_memory = planes(8)
    d_layout, d_caches, d_memory = planes(12)
    assert p_layout.state is not None and d_layout.state is not None
    p_memory.copy_(torch.randint(-128, 128, p_memory.shape, dtype=torch.int8))
    before = d_memory.clone()
    p_kv, d_kv = p_layout.state.kv_parts, d_layout.state.kv_parts
    length = state_length(d_kv)
    src = [u for block in (1, 2) for u in placed_units(p_kv, block, 0, length)]
    dst = [u for block in (6, 7) for u in placed_units(d_kv, block, 0, length)]
    copy_units(p_layout, p_memory, d_layout, d_memory, src, dst)
    for region in range(REGIONS):
        for tensor in range(2):  # K, V
            p_kv_tensor = p_caches[f"a{region}"][tensor]
            d_kv_tensor = d_caches[f"a{region}"][tensor]
            assert same_bytes(d_kv_tensor[6:8], p_kv_tensor[1:3])
    changed = (d_memory != before).nonzero().flatten().tolist()
    assert changed
    # Only K and V of blocks 6 and 7: never a conv state, nor another block.
    for i in changed:
        offset = i % (12 * PAGE) - 12 * CONV_BYTES
        assert offset >= 0 and (offset % (12 * SSM_BYTES)) // SSM_BYTES in (6, 7)


def same_bytes(a: Any, b: Any) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def moved_units(mode: str, p: KVLayout, d: KVLayout) -> dict[int, tuple[list[int], list[int]]]:
    """Per P rank, the units of P's state of block 3 and of D's block 5 they land in."""
    assert p.state is not None and d.state is not None
    if mode == "pull":
        return d.state.reads([(1, 3, 5)], 1, parts_by_group(state_parts(p.state)), 0)
    runs = d.state.writes([(1, 5)], 1, 0)[0]
    assert len(runs) == 2  # one per plane of D's state
    registration = PushRegistration(
        "r",
        1,
        (),
        (),
        (),
        (0, 1),
        5.0,
        state_runs=tuple(StateRun(*r) for r in runs),
        state_grant=1,
        num_tokens=7,
    )
    send = SendSpec("r", 1, 0, 0, ((10,), (3,)), num_tokens=7)
    return {0: state_pairs(send, registration, p.state)}


def copy_units(
    p: KVLayout, p_memory: Any, d: KVLayout, d_memory: Any, src: list[int], dst: list[int]
) -> None:
    """What the engine does with a state read: unit i of every region, P's to D's."""
    assert p.state is not None and d.state is not None
    unit = d.state.unit_bytes
    for p_region, d_region in zip(p.state.regions, d.state.regions, strict=True):
        p_base = p_region - p_memory.data_ptr()
        d_base = d_region - d_memory.data_ptr()
        for s, t in zip(src, dst, strict=True):
            d_memory[d_base + t * unit : d_base + (t + 1) * unit] = p_memory[
                p_base + s * unit : p_base + (s + 1) * unit
            ]
