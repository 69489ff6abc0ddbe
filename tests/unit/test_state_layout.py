"""state_layout over memory laid out as vLLM lays a hybrid state model's KV out on CPU: one
int8 buffer per layer slot, each an attention layer's blocks and, block by block, a state
layer's pages (conv state from byte 0, then ssm state, then padding)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from hixl_connector.connector.kv.layout import describe_kv_caches
from hixl_connector.connector.kv.state_layout import Sharding, model_n_groups, state_layer_specs
from hixl_connector.connector.mapping.state_groups import StatePart
from hixl_connector.connector.mapping.state_shards import ShardMismatch
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.peers.handshake import describe_mismatch
from hixl_connector.connector.push.registration import PushRegistration, StateRun
from hixl_connector.connector.push.request_push import state_pairs

NUM_BLOCKS = 8
HEADS, BLOCK_SIZE, HEAD_SIZE = 2, 16, 16
PAGE = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # bf16 K and V: 2048 bytes
CONV, SSM = (3, 64), (2, 8, 8)
STATE = 3 * 64 * 2 + 2 * 8 * 8 * 4  # bf16 conv, fp32 ssm: 896 bytes
REGIONS = 2


def hybrid(
    ssm_dtype: torch.dtype = torch.float32,
    heads: int = HEADS,
    head_size: int = HEAD_SIZE,
    shapes: tuple[tuple[int, ...], ...] = (CONV, SSM),
) -> tuple[dict[str, Any], KVCacheConfig, Any]:
    """vLLM's kv_caches and KV-cache config of two attention layers and two state layers in
    two shared buffers, and the buffer itself."""
    page = heads * BLOCK_SIZE * 2 * head_size * 2
    state = math.prod(shapes[0]) * 2 + math.prod(shapes[1]) * ssm_dtype.itemsize
    buffer = torch.zeros(REGIONS * NUM_BLOCKS * page, dtype=torch.int8)
    kv_caches: dict[str, Any] = {}
    for region in range(REGIONS):
        start = region * NUM_BLOCKS * page
        raw = buffer[start : start + NUM_BLOCKS * page]
        kv_caches[f"a{region}"] = raw.view(torch.bfloat16).view(
            NUM_BLOCKS, heads, BLOCK_SIZE, 2 * head_size
        )
        kv_caches[f"m{region}"] = torch.as_strided(
            buffer, (NUM_BLOCKS, 1, 1, state), (page, state, state, 1), start
        )
    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=1024,
        shapes=shapes,
        dtypes=(torch.bfloat16, ssm_dtype),
        page_size_padded=page,
    )
    groups = [KVCacheGroupSpec(["a0", "a1"], attention), KVCacheGroupSpec(["m0", "m1"], mamba)]
    return kv_caches, KVCacheConfig(NUM_BLOCKS, [], groups), buffer


def describe(kv_caches: dict[str, Any], config: KVCacheConfig, sharding: Any = None) -> Any:
    heads = config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
    return describe_kv_caches(
        kv_caches,
        NUM_BLOCKS,
        heads,
        groups_share_buffers=True,
        state_specs=state_layer_specs(config),
        sharding=sharding,
    )


def test_the_state_is_registered_in_whole_units_over_the_attention_buffers() -> None:
    kv_caches, config, buffer = hybrid()
    layout = describe(kv_caches, config)
    state = layout.state
    assert state is not None
    assert layout.num_layers == REGIONS and layout.block_bytes == PAGE
    assert state.regions == layout.tensor_addrs
    assert state.unit_bytes == 128  # gcd(2048, 896)
    # One part: a block's state is contiguous, a page apart.
    assert state.group_parts == ((1, (StatePart(0, PAGE // 128, STATE // 128),)),)
    assert state.group_units == ((1, STATE // 128),)
    assert state.region_units == ((NUM_BLOCKS - 1) * PAGE + STATE) // 128
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
    # A layer of the group laid out otherwise than the others.
    start = NUM_BLOCKS * PAGE
    kv_caches["m1"] = torch.as_strided(
        buffer, (NUM_BLOCKS, 1, 1, STATE), (PAGE // 2, 1, 1, 1), start
    )
    with pytest.raises(ValueError, match="state layer m1 lies in its buffer as"):
        describe(kv_caches, config)
    # A state whose bytes are not what its MambaSpec makes.
    kv_caches["m1"] = torch.as_strided(buffer, (NUM_BLOCKS, 1, 1, 512), (PAGE, 1, 1, 1), start)
    with pytest.raises(ValueError, match=r"state layer m1: parts of \[512\] bytes a block"):
        describe(kv_caches, config)
    # Blocks whose states overlap.
    kv_caches["m1"] = torch.as_strided(buffer, (NUM_BLOCKS, 1, 1, STATE), (512, 1, 1, 1), start)
    with pytest.raises(ValueError, match="blocks of 896 bytes only 512 bytes apart"):
        describe(kv_caches, config)
    # Parts in two allocations: the span between them is no memory of the state's.
    conv = torch.as_strided(buffer, (NUM_BLOCKS, 3 * 64 * 2), (PAGE, 1), start)
    elsewhere = torch.zeros(NUM_BLOCKS, 2, 8, 8)
    kv_caches["m1"] = [conv.view(torch.bfloat16).view(NUM_BLOCKS, 3, 64), elsewhere]
    with pytest.raises(ValueError, match="beyond the memory they lie in"):
        describe(kv_caches, config)
    kv_caches, config, _ = hybrid()
    # A state in memory of its own, beside no attention layer.
    alone = torch.zeros(NUM_BLOCKS * PAGE, dtype=torch.int8)
    kv_caches["m0"] = torch.as_strided(alone, (NUM_BLOCKS, 1, 1, STATE), (PAGE, 1, 1, 1))
    with pytest.raises(ValueError, match="state layer m0 lies in no buffer of an attention"):
        describe(kv_caches, config)


# A Mamba2 layer of 4 heads of 16 x 8, kernel 4 (vLLM's shapes, DS layout).
MAMBA2 = {"intermediate_size": 64, "num_heads": 4, "head_dim": 16}


def mamba2_rank(tp: int, n_groups: int = 2) -> tuple[dict[str, Any], KVCacheConfig, Any]:
    """One TP rank's buffers: its KV heads of 2, its state shapes."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp, n_groups=n_groups, state_size=8, conv_kernel=4, **MAMBA2
    )
    return hybrid(heads=HEADS // tp, head_size=32, shapes=shapes)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("n_groups", [1, 2])
def test_a_decode_rank_of_another_tp_size_gets_its_slices_of_the_state(
    conv_layout_ds: None, n_groups: int, mode: str
) -> None:
    """P at TP 1, D at TP 2 (and back), read by D or written by P from the runs D
    registers: every byte of each D rank's state of block 5 comes from P's state of block 3
    as vLLM shards it (one group: every rank holds it), and nothing else of D's pages
    changes."""
    channels = 64 + 2 * n_groups * 8
    for p_tp, d_tp in ((1, 2), (2, 1)):
        p_ranks = [mamba2_rank(p_tp, n_groups) for _ in range(p_tp)]
        d_ranks = [mamba2_rank(d_tp, n_groups) for _ in range(d_tp)]
        p_layouts = [describe(c, k, Sharding(p_tp, n_groups)) for c, k, _ in p_ranks]
        d_layouts = [describe(c, k, Sharding(d_tp, n_groups)) for c, k, _ in d_ranks]
        p_fields = p_layouts[0].state.compatibility_fields()
        assert p_fields == d_layouts[0].state.compatibility_fields()
        # P's state in block 3: its conv (channels x 3) and ssm as vLLM's kernels see them.
        conv_global = torch.arange(channels * 3, dtype=torch.bfloat16).view(channels, 3)
        ssm_global = torch.arange(4 * 16 * 8, dtype=torch.float32).view(4, 16, 8) + 0.5
        for rank, (caches, _, _) in enumerate(p_ranks):
            for region in range(REGIONS):
                write_state(caches[f"m{region}"][3], shard(conv_global, ssm_global, p_tp, rank))
        for rank, ((caches, _, buffer), layout) in enumerate(zip(d_ranks, d_layouts, strict=True)):
            before = buffer.clone()
            state = layout.state
            p_states = [p.state for p in p_layouts]
            reads = moved_units(mode, state, p_states, p_tp, rank)
            assert set(reads) == (set(range(p_tp)) if p_tp > d_tp else {rank * p_tp // d_tp})
            for p_rank, (src, dst) in reads.items():
                copy_units(p_ranks[p_rank][2], buffer, src, dst, p_layouts[p_rank], layout)
            expected = shard(conv_global, ssm_global, d_tp, rank)
            for region in range(REGIONS):
                page = caches[f"m{region}"][5].flatten().view(torch.uint8)
                assert torch.equal(page[: expected.numel()], expected)
            changed = (buffer != before).nonzero().flatten()
            page_bytes = layout.block_bytes
            assert all(
                5 * page_bytes <= i % (NUM_BLOCKS * page_bytes) < 6 * page_bytes for i in changed
            )


def moved_units(
    mode: str, state: Any, p_states: list[Any], p_tp: int, rank: int
) -> dict[int, tuple[list[int], list[int]]]:
    """Per P rank, the units of its state slot 3 and of D rank ``rank``'s slot 5 they land
    in: as D reads them, or as each P rank writes them from the runs D registers with it."""
    if mode == "pull":
        return state.reads([(1, 3, 5)], p_tp, dict(p_states[0].group_parts), rank)
    send = SendSpec("r", 1, 0, 0, ((10,), (3,)), num_tokens=7)
    written = {}
    for p_rank, runs in state.writes([(1, 5)], p_tp, rank).items():
        state_runs = tuple(StateRun(*run) for run in runs)
        registration = PushRegistration(
            "r", 1, (), (), (), (0, 1), 5.0, state_runs=state_runs, state_grant=1, num_tokens=7
        )
        written[p_rank] = state_pairs(send, registration, p_states[p_rank])
    return written


def shard(conv: Any, ssm: Any, tp: int, rank: int) -> Any:
    """Rank ``rank``'s state bytes: its slice of x, B and C (groups of 8; a single group on
    every rank), then its heads."""
    groups = (conv.shape[0] - 64) // 16
    x, b, c = conv[:64], conv[64 : 64 + 8 * groups], conv[64 + 8 * groups :]
    mine = [x.chunk(tp)[rank], *(p if groups == 1 else p.chunk(tp)[rank] for p in (b, c))]
    conv_bytes = torch.cat(mine).contiguous().view(torch.uint8).flatten()
    ssm_bytes = ssm.chunk(tp)[rank].contiguous().view(torch.uint8).flatten()
    return torch.cat([conv_bytes, ssm_bytes])


def write_state(page: Any, state: Any) -> None:
    page.flatten().view(torch.uint8)[: state.numel()] = state


def copy_units(
    src_buffer: Any, dst_buffer: Any, src: list[int], dst: list[int], p: Any, d: Any
) -> None:
    """What the engine does with a state read: unit i of every region, P's to D's."""
    unit = d.state.unit_bytes
    assert p.state.unit_bytes == unit
    for region in range(REGIONS):
        p_base = region * NUM_BLOCKS * p.block_bytes
        d_base = region * NUM_BLOCKS * d.block_bytes
        for s, t in zip(src, dst, strict=True):
            dst_buffer[d_base + t * unit : d_base + (t + 1) * unit] = src_buffer[
                p_base + s * unit : p_base + (s + 1) * unit
            ]


def test_a_state_that_does_not_divide_is_refused_between_tp_sizes(conv_layout_ds: None) -> None:
    """Equal TP sizes read it whole; another TP size is refused, naming why."""
    layout = describe(*mamba2_rank(1)[:2], Sharding(1, 2))
    state = layout.state
    state.check_tp(2)  # divides
    assert set(state.reads([(1, 0, 0)], 1, dict(state.group_parts), 0)) == {0}
    # A Mamba2 layer at TP 2 whose n_groups the model config does not give.
    unknown = describe(*mamba2_rank(2)[:2], Sharding(2))
    with pytest.raises(ShardMismatch, match="tp_size=1 and decode tp_size=2 differ.*n_groups"):
        unknown.state.check_tp(1)
    unknown.state.check_tp(2)


def test_under_the_sd_layout_the_state_moves_between_equal_tp_sizes_only() -> None:
    state = describe(*mamba2_rank(1)[:2], Sharding(1, 2)).state
    assert state.compatibility_fields()["kv_state_conv_layout"] == "SD"
    with pytest.raises(ShardMismatch, match="VLLM_SSM_CONV_STATE_LAYOUT=DS on prefill and"):
        state.check_tp(2)
    with pytest.raises(ShardMismatch):
        state.reads([(1, 0, 0)], 2, dict(state.group_parts), 0)
    with pytest.raises(ShardMismatch):
        state.writes([(1, 0)], 2, 0)
    whole = dict(state.group_units)[1]  # between equal TP sizes: the whole state
    assert state.writes([(1, 2)], 1, 0) == {0: [(1, 0, state.units(1, 2)[0], whole)]}


def test_the_mamba2_groups_are_read_from_each_family_config() -> None:
    """The configs of the Mamba2 families name n_groups three ways."""
    from transformers import (
        FalconH1Config,
        GraniteMoeHybridConfig,
        LlamaConfig,
        NemotronHConfig,
        Zamba2Config,
    )

    assert model_n_groups(NemotronHConfig(n_groups=2)) == 2
    assert model_n_groups(GraniteMoeHybridConfig(mamba_n_groups=1)) == 1
    assert model_n_groups(FalconH1Config(mamba_n_groups=1)) == 1
    assert model_n_groups(Zamba2Config(mamba_ngroups=4)) == 4
    assert model_n_groups(LlamaConfig()) is None
