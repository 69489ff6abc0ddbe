"""block_slices: decode blocks assembled from smaller prefill blocks, checked by moving
simulated memory with the ids it produces."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.block_slices import (
    SLICE_ELEMENTS,
    BlockSizeMismatch,
    SliceRun,
    blocks_per_block,
    merge_runs,
    slice_ids,
)
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID, remote_at_positions

Key = tuple[int, int, int]  # (0 key / 1 value, token within the block, dimension)
Layout = Callable[[int, int], list[Key]]  # (block size, head size) -> keys in memory order


def transposed_keys(block_size: int, head_size: int) -> list[Key]:
    """vLLM's vector kernels: keys as [head_size, block_size], then values [block_size, hs]."""
    keys = [(0, t, d) for d in range(head_size) for t in range(block_size)]
    return keys + [(1, t, d) for t in range(block_size) for d in range(head_size)]


def token_major(block_size: int, head_size: int) -> list[Key]:
    return [(kv, t, d) for kv in (0, 1) for t in range(block_size) for d in range(head_size)]


LAYOUTS = [transposed_keys, token_major]
block_sizes = st.sampled_from([32, 64, 96, 128])
head_sizes = st.sampled_from([32, 64, 96])


@given(block_sizes, st.integers(2, 5))
def test_a_prefill_block_smaller_than_and_dividing_decode_s_maps(p: int, ratio: int) -> None:
    assert blocks_per_block([p], [p * ratio]) == ratio
    assert blocks_per_block([p], [p]) == 1
    assert blocks_per_block([p, p], [p, p]) == 1


@pytest.mark.parametrize(
    ("p", "d"), [([64], [32]), ([48], [64]), ([32, 32], [64, 64]), ([32], [32, 32]), ([0], [32])]
)
def test_every_other_pair_is_refused_naming_both_sizes(p: list[int], d: list[int]) -> None:
    with pytest.raises(BlockSizeMismatch, match=rf"prefill block_size \{p}, decode block_size"):
        blocks_per_block(p, d)


def runs_for(layout: Layout, p: int, ratio: int, head_size: int) -> tuple[SliceRun, ...]:
    src = [(kv, part * p + t, d) for part in range(ratio) for kv, t, d in layout(p, head_size)]
    where = {key: divmod(i, 2 * p * head_size) for i, key in enumerate(src)}
    return merge_runs(
        [where[key] for key in layout(p * ratio, head_size)], 2 * p * head_size, ratio
    )


@given(st.sampled_from(LAYOUTS), block_sizes, st.integers(1, 4), head_sizes)
def test_runs_rebuild_a_decode_unit_exactly(
    layout: Layout, p: int, ratio: int, head_size: int
) -> None:
    runs = runs_for(layout, p, ratio, head_size)
    parts = [[(kv, part * p + t, d) for kv, t, d in layout(p, head_size)] for part in range(ratio)]
    rebuilt: list[Key | None] = [None] * (2 * p * ratio * head_size)
    for run in runs:
        for i in range(run.count * SLICE_ELEMENTS):
            dst = run.dst * SLICE_ELEMENTS + i
            assert rebuilt[dst] is None, "two runs write one element"
            rebuilt[dst] = parts[run.part][run.src * SLICE_ELEMENTS + i]
    assert rebuilt == layout(p * ratio, head_size)


def test_the_transposed_layout_moves_one_row_per_run_and_values_whole() -> None:
    runs = runs_for(transposed_keys, 32, 2, 64)
    assert len(runs) == 2 * 64 + 2  # a row of keys per part, then each part's values
    assert runs[-1] == SliceRun(1, 64, 64 * 2 + 64, 64)
    assert len(runs_for(token_major, 32, 2, 64)) == 4


def test_a_layout_that_is_no_rearrangement_is_refused() -> None:
    origins = [(0, i) for i in range(64)]
    with pytest.raises(ValueError, match="not a rearrangement"):
        merge_runs(origins[:32] + origins[:32], 64, 1)
    with pytest.raises(ValueError, match="cannot be 2 prefill units"):
        merge_runs(origins, 64, 2)
    shifted = [(0, (i + 1) % 64) for i in range(64)]
    with pytest.raises(ValueError, match="aligned 32-element slice"):
        merge_runs(shifted, 64, 1)


@given(
    st.sampled_from(LAYOUTS),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 2),
    st.data(),
)
def test_slice_ids_land_every_head_of_every_block_in_place(
    layout: Layout, ratio: int, d_blocks: int, heads: int, first: int, data: st.DataObject
) -> None:
    """Simulated memories of both sides: P's blocks hold ``first + heads`` KV heads of which
    D reads ``heads`` (TP: a head slice) into its blocks of ``heads`` heads."""
    p, head_size = 32, 32
    p_units, d_units = first + heads, heads
    unit_p = 2 * p * head_size
    slices_p, slices_d = unit_p // SLICE_ELEMENTS, ratio * unit_p // SLICE_ELEMENTS
    prompt = data.draw(st.integers((d_blocks - 1) * ratio * p + 1, d_blocks * ratio * p))
    n_p = -(-prompt // p)
    p_ids = data.draw(st.permutations(range(1, 2 * n_p + 1)))[:n_p]
    d_ids = data.draw(st.permutations(range(1, 2 * d_blocks + 1)))[:d_blocks]
    remote = remote_at_positions(p_ids, range(d_blocks), ratio)
    assert remote.count(NULL_BLOCK_ID) == d_blocks * ratio - n_p
    runs = runs_for(layout, p, ratio, head_size)
    src, dst = slice_ids(
        remote, d_ids, runs, ratio, (p_units, first, slices_p), (d_units, 0, slices_d), heads
    )
    assert len(set(dst)) == len(dst) == n_p * heads * slices_p
    # Memory as slice id -> what the slice holds: (block, head, element keys).
    p_memory = {}
    for position, block in enumerate(p_ids):
        for unit in range(p_units):
            keys = [(kv, position * p + t, d) for kv, t, d in layout(p, head_size)]
            for s in range(slices_p):
                chunk = keys[s * SLICE_ELEMENTS : (s + 1) * SLICE_ELEMENTS]
                p_memory[(block * p_units + unit) * slices_p + s] = (unit, chunk)
    d_memory = {d: p_memory[s] for s, d in zip(src, dst, strict=True)}
    for i, block in enumerate(d_ids):
        for head in range(heads):
            want = layout(p * ratio, head_size)
            for s in range(slices_d):
                chunk = want[s * SLICE_ELEMENTS : (s + 1) * SLICE_ELEMENTS]
                got = d_memory.get((block * d_units + head) * slices_d + s)
                global_tokens = [i * ratio * p + t for _, t, _ in chunk]
                if min(global_tokens) >= n_p * p:
                    assert got is None  # past P's last block: nothing read
                    continue
                assert got is not None
                assert got[0] == first + head
                assert got[1] == [(kv, i * ratio * p + t, d) for kv, t, d in chunk]


def test_slice_ids_refuse_a_block_list_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="3 prefill blocks for 2 decode blocks of 2 each"):
        slice_ids([1, 2, 3], [4, 5], (), 2, (1, 0, 2), (1, 0, 4), 1)
