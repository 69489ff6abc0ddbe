"""Properties of the pure block-mapping functions, checked with hypothesis."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.blocks import (
    blocks_for_tokens,
    chunk_pairs,
    remote_at_positions,
)
from hixl_connector.connector.mapping.runs import runs_of


def group_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """The runs of block pairs (one key), as the native planner's plan_runs gives them."""
    return [(s, d, n) for _, s, d, n in runs_of((0, s, d) for s, d in zip(src, dst, strict=True))]


block_ids = st.lists(st.integers(min_value=0, max_value=200), max_size=60)
# Blocks P offers: never vLLM's null block (0), which marks a position a group no longer holds.
offered_ids = st.lists(st.integers(min_value=1, max_value=200), max_size=60)


@st.composite
def paired_lists(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Equal-length src/dst lists, biased towards long contiguous stretches."""
    src: list[int] = []
    dst: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        length = draw(st.integers(1, 8))
        s0 = draw(st.integers(0, 500))
        d0 = draw(st.integers(0, 500))
        src += range(s0, s0 + length)
        dst += range(d0, d0 + length)
    return src, dst


@st.composite
def any_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Either structured runs or arbitrary ids (duplicates, descending, gaps)."""
    if draw(st.booleans()):
        return draw(paired_lists())
    src = draw(block_ids)
    dst = draw(st.lists(st.integers(0, 200), min_size=len(src), max_size=len(src)))
    return src, dst


def pair_blocks(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(src, dst) pairs in order: what the runs must reassemble to."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} != {len(dst)}")
    return list(zip(src, dst, strict=True))


def expand(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(s + i, d + i) for s, d, length in runs for i in range(length)]


@given(any_pairs())
def test_runs_reassemble_exactly_to_the_pairs(lists: tuple[list[int], list[int]]) -> None:
    src, dst = lists
    assert expand(group_runs(src, dst)) == pair_blocks(src, dst)


@given(any_pairs())
def test_runs_are_maximal_and_non_empty(lists: tuple[list[int], list[int]]) -> None:
    runs = group_runs(*lists)
    assert all(length >= 1 for _, _, length in runs)
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:], strict=False):
        # Two neighbouring runs could have been one run iff both sides continue.
        assert not (s2 == s1 + n1 and d2 == d1 + n1)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 300))
def test_fully_contiguous_lists_make_one_run(s0: int, d0: int, n: int) -> None:
    assert group_runs(range(s0, s0 + n), range(d0, d0 + n)) == [(s0, d0, n)]


@given(block_ids)
def test_runs_break_when_only_one_side_is_contiguous(src: list[int]) -> None:
    dst = [2 * i for i in range(len(src))]  # never contiguous
    assert [length for _, _, length in group_runs(src, dst)] == [1] * len(src)


@given(any_pairs(), st.integers(1, 20))
def test_chunks_preserve_order_and_respect_the_limit(
    lists: tuple[list[int], list[int]], max_pairs: int
) -> None:
    src, dst = lists
    chunks = chunk_pairs(src, dst, max_pairs)
    assert all(1 <= len(s) == len(d) <= max_pairs for s, d in chunks)
    assert [x for s, _ in chunks for x in s] == src
    assert [x for _, d in chunks for x in d] == dst
    # Only the last chunk may be short, so the number of calls is minimal.
    assert all(len(s) == max_pairs for s, _ in chunks[:-1])
    assert len(chunks) == -(-len(src) // max_pairs)


@given(offered_ids, st.data())
def test_positions_pick_the_blocks_holding_the_same_tokens(
    remote: list[int], data: st.DataObject
) -> None:
    hit = data.draw(st.integers(0, len(remote)))
    positions = list(range(hit, len(remote)))
    mapped = remote_at_positions(remote, positions)
    assert list(mapped) == remote[hit:]  # D's prefix hits lead: it pulls P's tail
    assert remote[:hit] + list(mapped) == remote


@given(offered_ids, st.data())
def test_a_position_the_prefill_side_dropped_is_never_read(
    remote: list[int], data: st.DataObject
) -> None:
    """A sliding-window group offers the null block where its blocks left the window."""
    dropped = data.draw(st.integers(0, len(remote)))
    window = [0] * dropped + remote
    assert remote_at_positions(window, range(dropped, len(window))) == tuple(remote)
    if dropped:
        needed = data.draw(st.integers(0, dropped - 1))
        with pytest.raises(ValueError, match=f"block {needed}, which the prefill side no"):
            remote_at_positions(window, range(needed, len(window)))


def test_no_positions_pull_nothing() -> None:
    assert remote_at_positions([4, 5, 6], []) == ()


@given(block_ids)
def test_a_position_beyond_the_remote_prompt_is_an_error(remote: list[int]) -> None:
    with pytest.raises(ValueError, match="offers only"):
        remote_at_positions(remote, list(range(len(remote) + 1)))


def test_a_longer_remote_list_does_not_shift_the_mapping() -> None:
    # P announced blocks beyond the prompt (e.g. its generated tokens): D's positions still
    # select the prompt's blocks, never the tail of P's list.
    assert remote_at_positions([10, 11, 12, 13], [1, 2]) == (11, 12)


@given(st.integers(0, 10**6), st.integers(1, 512))
def test_blocks_for_tokens_is_the_ceiling(num_tokens: int, block_size: int) -> None:
    blocks = blocks_for_tokens(num_tokens, block_size)
    assert blocks * block_size >= num_tokens
    assert (blocks - 1) * block_size < num_tokens or blocks == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pair_blocks([1, 2], [3]), "differ in length"),
        (lambda: chunk_pairs([1], [2], 0), "max_pairs"),
        (lambda: chunk_pairs([1, 2], [2], 4), "differ in length"),
        (lambda: blocks_for_tokens(5, 0), "block_size"),
        (lambda: blocks_for_tokens(-1, 16), "num_tokens"),
    ],
)
def test_bad_arguments_raise_clear_errors(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_empty_inputs() -> None:
    assert group_runs([], []) == []
    assert chunk_pairs([], [], 3) == []
    assert pair_blocks([], []) == []


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(0, 9)), max_size=40))
def test_runs_of_keyed_steps_expand_to_the_steps_and_are_maximal(
    steps: list[tuple[int, int, int]],
) -> None:
    runs = runs_of(steps)
    assert [(k, s + i, d + i) for k, s, d, n in runs for i in range(n)] == steps
    for (k1, s1, d1, n1), (k2, s2, d2, _) in zip(runs, runs[1:], strict=False):
        assert not (k1 == k2 and s2 == s1 + n1 and d2 == d1 + n1)
