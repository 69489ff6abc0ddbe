"""state_groups and the reads of a hybrid state model's state: the N-1 counts, the state slot
(no prefix caching, align, scratch slots), the state's bytes and units, and what D's scheduler
reads of P's state slot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.mapping.kv_groups import (
    blocks_to_fill,
    group_block_sizes,
    remote_blocks_to_read,
)
from hixl_connector.connector.mapping.state_groups import (
    StateGroups,
    StatePart,
    parts_by_group,
    placed_runs,
    placed_units,
    state_bytes,
    state_groups,
    state_length,
    state_slot,
    tokens_to_load,
)
from hixl_connector.connector.transfer_params import RemotePrefill

NONE = StateGroups((1,), "none", 0)


@dataclass(frozen=True)
class Block:
    block_id: int
    block_hash: object = None
    is_null: bool = False


@given(st.integers(0, 10_000), st.booleans())
def test_a_state_model_loads_all_but_the_last_prompt_token(tokens: int, state: bool) -> None:
    loaded = tokens_to_load(tokens, state)
    assert loaded == (max(tokens - 1, 0) if state else tokens)
    # D computes what is not loaded: for a state model, exactly the last token.
    assert tokens - loaded == (1 if state and tokens else 0)


def test_a_negative_token_count_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        tokens_to_load(-1, True)


@given(st.integers(1, 4096), st.integers(0, 3), st.integers(1, 4096))
def test_without_prefix_caching_the_state_is_the_first_slot_before_the_scratch_slots(
    tokens: int, scratch: int, block_size: int
) -> None:
    groups = StateGroups((0,), "none", scratch)
    assert state_slot(1 + scratch, tokens, block_size, groups) == 0
    with pytest.raises(ValueError, match="no state slot"):
        state_slot(scratch, tokens, block_size, groups)  # only scratch slots: none to read


@given(st.integers(1, 4096), st.integers(0, 3), st.sampled_from([16, 32, 64, 528]))
def test_with_aligned_prefix_caching_the_state_is_the_slot_of_the_last_tokens_block(
    tokens: int, scratch: int, block_size: int
) -> None:
    groups = StateGroups((0,), "align", scratch)
    position = math.ceil(tokens / block_size) - 1
    row = position + 1 + scratch  # null placeholders, the state, the scratch slots
    assert state_slot(row, tokens, block_size, groups) == position
    assert position == (tokens - 1) // block_size
    with pytest.raises(ValueError, match="no state slot"):
        state_slot(row - 1, tokens, block_size, groups)  # the state would be a scratch slot


def test_no_state_before_a_token_nor_in_an_unknown_cache_mode() -> None:
    with pytest.raises(ValueError, match="no state after 0 tokens"):
        state_slot(1, 0, 16, NONE)
    with pytest.raises(ValueError, match="mamba_cache_mode 'all'"):
        state_slot(4, 10, 16, StateGroups((0,), "all", 0))


@given(
    st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=3), min_size=1, max_size=2),
    st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=2),
)
def test_a_state_layers_bytes_are_its_parts_in_page_order(
    shapes: list[list[int]], sizes: list[int]
) -> None:
    layer = state_bytes(shapes, sizes[: len(shapes)])
    assert layer.parts == tuple(math.prod(s) * z for s, z in zip(shapes, sizes, strict=False))
    assert layer.nbytes == sum(layer.parts)


def test_state_parts_and_dtypes_must_pair() -> None:
    with pytest.raises(ValueError, match="state shapes"):
        state_bytes([(4, 8), (2,)], [2])
    with pytest.raises(ValueError, match="state shapes"):
        state_bytes([], [])


@given(st.integers(0, 1000), st.integers(1, 64), st.data())
def test_on_pages_a_blocks_state_is_the_leading_units_of_its_page_and_never_its_padding(
    block: int, page_units: int, data: st.DataObject
) -> None:
    length = data.draw(st.integers(1, page_units))
    parts = [StatePart(0, page_units, length)]
    start = data.draw(st.integers(0, length - 1))
    count = data.draw(st.integers(1, length - start))
    units = placed_units(parts, block, start, count)
    first = block * page_units + start
    assert units == list(range(first, first + count))
    assert placed_runs(parts, block, start, count) == [(first, count)]
    # Never another block's page, nor the page's padding.
    assert min(units) >= block * page_units and max(units) < block * page_units + length


@given(st.integers(1, 64), st.integers(1, 32), st.integers(1, 32), st.data())
def test_on_planes_a_blocks_state_is_its_conv_units_then_its_ssm_units(
    num_blocks: int, conv: int, ssm: int, data: st.DataObject
) -> None:
    # vllm-ascend: every block's conv state, then every block's ssm state.
    parts = [StatePart(0, conv, conv), StatePart(num_blocks * conv, ssm, ssm)]
    block = data.draw(st.integers(0, num_blocks - 1))
    whole = placed_units(parts, block, 0, conv + ssm)
    assert whole[:conv] == list(range(block * conv, (block + 1) * conv))
    ssm_first = num_blocks * conv + block * ssm
    assert whole[conv:] == list(range(ssm_first, ssm_first + ssm))
    # Any slice of the state is the same slice of the whole, in at most one run per plane.
    start = data.draw(st.integers(0, conv + ssm - 1))
    count = data.draw(st.integers(1, conv + ssm - start))
    assert placed_units(parts, block, start, count) == whole[start : start + count]
    assert len(placed_runs(parts, block, start, count)) == 1 + (start < conv < start + count)
    # Blocks never share a unit, and all lie in the two planes.
    others = [
        u for b in range(num_blocks) if b != block for u in placed_units(parts, b, 0, conv + ssm)
    ]
    assert not set(whole) & set(others)
    assert all(0 <= unit < num_blocks * (conv + ssm) for unit in whole)


def test_units_beyond_a_blocks_state_are_refused() -> None:
    parts = [StatePart(0, 4, 2), StatePart(100, 3, 3)]
    for block, start, count in ((0, 0, 6), (0, 5, 1), (-1, 0, 1), (0, -1, 1), (0, 0, 0)):
        with pytest.raises(ValueError, match="state of 5 units"):
            placed_runs(parts, block, start, count)


def test_the_handshakes_rows_give_each_groups_parts_in_order() -> None:
    rows = [[1, 0, 36, 7], [3, 0, 12, 12], [3, 768, 16, 16]]
    assert parts_by_group(rows) == {
        1: (StatePart(0, 36, 7),),
        3: (StatePart(0, 12, 12), StatePart(768, 16, 16)),
    }
    assert state_length(parts_by_group(rows)[3]) == 28


def test_the_state_groups_of_a_kv_cache_config() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(
        block_size=512, shapes=((4, 8),), dtypes=(torch.float32,), num_speculative_blocks=2
    )
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate((mamba, full, mamba))]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    found = state_groups(config)
    assert found == StateGroups((0, 2), "none", 2) and 2 in found and 1 not in found
    assert not state_groups(None) and not state_groups(KVCacheConfig(8, [], groups[1:2]))
    aligned = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    mixed = [KVCacheGroupSpec(["a"], mamba), KVCacheGroupSpec(["b"], aligned)]
    with pytest.raises(ValueError, match="differ in mamba_cache_mode"):
        state_groups(KVCacheConfig(8, [], mixed))


def test_a_state_group_takes_the_attention_block_size_not_max_model_len() -> None:
    """Without prefix caching of the state, vLLM gives a state group max_model_len as its
    block size; it says nothing of the one slot, and P and D may differ in it."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=160, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec([f"m{size}"], MambaSpec(size, ((4, 8),), (torch.float32,)))
        for size in (4096, 8192)
    ]
    config = KVCacheConfig(8, [], [groups[0], KVCacheGroupSpec(["a"], full), groups[1]])
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=32))
    assert group_block_sizes(vllm_config, config) == (160, 160, 160)


def _row(ids: list[int]) -> list[Block]:
    return [Block(i, is_null=i == NULL_BLOCK_ID) for i in ids]


@given(st.integers(1, 300), st.integers(0, 2))
def test_d_fills_the_token_blocks_of_n_minus_1_tokens_and_the_state_slot_alone(
    prompt: int, scratch: int
) -> None:
    tokens = tokens_to_load(prompt, True)
    groups = StateGroups((1,), "none", scratch)
    attention = _row(list(range(10, 10 + math.ceil(prompt / 16))))
    state = _row([50 + i for i in range(1 + scratch)])
    filled = blocks_to_fill([attention, state], None, [16, 4096], tokens, groups)
    wanted = math.ceil(tokens / 16)
    assert filled[0] == (tuple(range(wanted)), tuple(range(10, 10 + wanted)))
    # The state after N-1 tokens, never a scratch slot; nothing at all for a 1-token prompt.
    assert filled[1] == (((0,), (50,)) if tokens else ((), ()))


def test_d_reads_ps_one_state_slot_for_its_own() -> None:
    endpoint = RemoteEndpoint("p", "127.0.0.1", 1, 1, 0, 1)

    def prefill(num_tokens: int, state: tuple[int, ...]) -> RemotePrefill:
        return RemotePrefill(endpoint, "r", 7, 0, ((1, 2, 3), state), num_tokens, (16, 4096))

    unfilled = [((0, 1, 2), (20, 21, 22)), ((0,), (60,))]
    remote, ratio = remote_blocks_to_read(prefill(40, (9,)), 40, unfilled, (16, 4096), NONE)
    assert remote == ((1, 2, 3), (9,)) and ratio == 1
    # P's state is after exactly the tokens D continues from: one more or less is refused.
    for computed, reason in ((39, "this prompt needs 40"), (41, "state after 41 tokens")):
        with pytest.raises(ValueError, match=reason):
            remote_blocks_to_read(prefill(computed, (9,)), 40, unfilled, (16, 4096), NONE)
    with pytest.raises(ValueError, match="lack remote_num_tokens"):
        remote_blocks_to_read(
            RemotePrefill(endpoint, "r", 7, 0, ((1, 2, 3), (9,)), None),
            40,
            unfilled,
            (16, 16),
            NONE,
        )
    for offered in ((), (9, 10), (NULL_BLOCK_ID,)):
        with pytest.raises(ValueError, match="one state slot expected"):
            remote_blocks_to_read(prefill(40, offered), 40, unfilled, (16, 4096), NONE)
    # A model without state reads a longer prefill as before.
    plain = [((0, 1, 2), (20, 21, 22)), ((0, 1), (60, 61))]
    remote, _ = remote_blocks_to_read(
        RemotePrefill(endpoint, "r", 7, 0, ((1, 2, 3), (8, 9)), 41, (16, 16)),
        40,
        plain,
        (16, 16),
    )
    assert remote == ((1, 2, 3), (8, 9))


def test_a_state_group_is_no_config_of_attention_shape() -> None:
    """A plain SimpleNamespace spec is no state: only vLLM's MambaSpec (by name) is."""
    spec = SimpleNamespace(block_size=16)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    assert not state_groups(config)
