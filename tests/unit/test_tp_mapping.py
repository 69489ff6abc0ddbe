"""Heterogeneous-TP mapping, checked over every TP pair up to 16 and every head count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.tp_mapping import (
    HeadRead,
    TPMismatch,
    check_shardable,
    check_tp_pair,
    first_head,
    heads_per_rank,
    plan_rank,
    unit_ids,
)

TP_SIZES = (1, 2, 4, 8, 16, 3, 6, 12)
HEAD_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def valid_shapes() -> list[tuple[int, int, int]]:
    shapes = []
    for heads in HEAD_COUNTS:
        for p_tp in TP_SIZES:
            for d_tp in TP_SIZES:
                try:
                    check_tp_pair(heads, p_tp, d_tp)
                except TPMismatch:
                    continue
                shapes.append((heads, p_tp, d_tp))
    return shapes


SHAPES = valid_shapes()


def held_heads(heads: int, tp: int, rank: int) -> list[int]:
    """vLLM's sharding: consecutive slices, or one replicated head per rank."""
    first = first_head(heads, tp, rank)
    return list(range(first, first + heads_per_rank(heads, tp)))


def test_the_shapes_cover_both_directions_and_replication() -> None:
    assert (8, 2, 1) in SHAPES and (8, 1, 2) in SHAPES
    assert (2, 8, 1) in SHAPES and (2, 1, 8) in SHAPES and (2, 4, 16) in SHAPES
    assert len(SHAPES) > 150


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), SHAPES)
def test_every_d_head_is_read_once_from_a_p_rank_that_holds_it(
    heads: int, p_tp: int, d_tp: int
) -> None:
    for d_rank in range(d_tp):
        plan = plan_rank(heads, p_tp, d_tp, d_rank)
        mine = held_heads(heads, d_tp, d_rank)
        landed: list[int] = []
        for read in plan.reads:
            theirs = held_heads(heads, p_tp, read.p_rank)
            assert 0 <= read.src_head and read.src_head + read.count <= len(theirs)
            assert 0 <= read.dst_head and read.dst_head + read.count <= len(mine)
            for i in range(read.count):
                # The head read is the head that belongs at the destination slot.
                assert theirs[read.src_head + i] == mine[read.dst_head + i]
                landed.append(read.dst_head + i)
        assert sorted(landed) == list(range(len(mine)))


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), SHAPES)
def test_every_p_rank_hears_from_exactly_the_d_ranks_that_announce_it(
    heads: int, p_tp: int, d_tp: int
) -> None:
    plans = [plan_rank(heads, p_tp, d_tp, d) for d in range(d_tp)]
    for p_rank in range(p_tp):
        notifiers = [d for d, plan in enumerate(plans) if p_rank in plan.notify]
        readers = [d for d, plan in enumerate(plans) if plan.reads_from(p_rank)]
        assert notifiers, f"P rank {p_rank} would never be freed"
        assert set(readers) <= set(notifiers)
        if not readers:  # an unread replica: one designated D rank only
            assert len(notifiers) == 1
        else:
            assert notifiers == readers
        # Every notifier announces the same count, and it is the count of distinct ranks.
        assert {plans[d].consumers[p_rank] for d in notifiers} == {len(notifiers)}


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), SHAPES)
def test_reads_merge_consecutive_heads(heads: int, p_tp: int, d_tp: int) -> None:
    for d_rank in range(d_tp):
        reads = plan_rank(heads, p_tp, d_tp, d_rank).reads
        # One read per P rank: a rank's heads are consecutive on both sides.
        assert len({read.p_rank for read in reads}) == len(reads)
        assert [read.p_rank for read in reads] == sorted(read.p_rank for read in reads)
        assert len(reads) == max(1, min(p_tp, heads) // min(d_tp, heads))


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_equal_tp_is_one_whole_block_read_from_the_same_rank(heads: int, tp: int) -> None:
    if (heads, tp, tp) not in SHAPES:
        return
    for rank in range(tp):
        plan = plan_rank(heads, tp, tp, rank)
        assert plan.reads == (HeadRead(rank, 0, 0, heads_per_rank(heads, tp)),)
        assert plan.notify == (rank,) and plan.consumers == {rank: 1}


@pytest.mark.parametrize("p_tp", TP_SIZES)
@pytest.mark.parametrize("d_tp", TP_SIZES)
def test_replicated_caches_read_one_p_rank_spread_over_d_ranks(p_tp: int, d_tp: int) -> None:
    try:
        check_tp_pair(1, p_tp, d_tp, replicated=True)
    except TPMismatch:
        return
    plans = [plan_rank(1, p_tp, d_tp, d, replicated=True) for d in range(d_tp)]
    sources = [plan.reads[0].p_rank for plan in plans]
    assert all(len(plan.reads) == 1 for plan in plans)
    # Spread: no P rank serves more than its share of D ranks.
    assert max(sources.count(p) for p in range(p_tp)) == max(1, d_tp // p_tp)
    for p_rank in range(p_tp):
        assert any(p_rank in plan.notify for plan in plans)


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "message"),
    [
        (8, 3, 2, "multiple of the smaller"),
        (8, 6, 3, "does not divide num_kv_heads=8"),
        (4, 8, 1, None),
        (4, 6, 3, "not a multiple"),
        (0, 1, 1, "num_kv_heads"),
    ],
)
def test_pairs_that_cannot_map_are_refused_naming_why(
    heads: int, p_tp: int, d_tp: int, message: str | None
) -> None:
    if message is None:
        check_tp_pair(heads, p_tp, d_tp)
        return
    with pytest.raises(TPMismatch, match=message):
        plan_rank(heads, p_tp, d_tp, 0)


def test_a_d_rank_outside_its_tp_size_is_refused() -> None:
    with pytest.raises(TPMismatch, match="out of range"):
        plan_rank(8, 2, 2, 2)


@given(
    st.lists(st.integers(0, 1000), max_size=20),
    st.integers(1, 16),
    st.data(),
)
def test_unit_ids_address_each_head_of_each_block(
    blocks: list[int], per_block: int, data: st.DataObject
) -> None:
    first = data.draw(st.integers(0, per_block - 1))
    count = data.draw(st.integers(1, per_block - first))
    ids = unit_ids(blocks, per_block, first, count)
    assert len(ids) == len(blocks) * count
    for i, unit in enumerate(ids):
        block, head = divmod(unit, per_block)
        assert block == blocks[i // count] and head == first + i % count


def test_what_cannot_be_read_is_refused_naming_why() -> None:
    cpu = "cpu:AVX512/1x[32x64]"
    check_shardable("heads", cpu, 8, 4, 2)
    with pytest.raises(TPMismatch, match="prefill tp_size=3"):
        check_shardable("heads", cpu, 8, 3, 2)
    # Heads interleaved inside a block (Ascend's NHD): equal TP only, and the layout is named.
    check_shardable("none", "npu/2x[128x8x128]", 8, 2, 2)
    with pytest.raises(TPMismatch, match=r"'npu/2x\[128x8x128\]' interleaves KV heads"):
        check_shardable("none", "npu/2x[128x8x128]", 8, 2, 1)
    # MLA-style caches are whole on every rank: any pair where one size divides the other.
    check_shardable("replicated", cpu, 1, 8, 2)
