"""The pure parts of P's request push: which layers go in which write, which of P's blocks
D's registration names, and the in-order queue every request's writes run on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.mapping.state_groups import StatePart
from hixl_connector.connector.mapping.tp_mapping import (
    TPMismatch,
    check_tp_pair,
    first_head,
    heads_per_rank,
    plan_rank,
)
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.push.registration import (
    HeadRun,
    PushRegistration,
    Slices,
    StateRun,
)
from hixl_connector.connector.push.request_push import (
    head_runs,
    layer_ranges,
    pushed_slices,
    pushed_units,
    source_blocks,
    state_pairs,
)
from hixl_connector.connector.push.sender import ComputedLayers
from hixl_connector.connector.push.serial_jobs import SerialJobs


@given(st.sets(st.integers(0, 80)))
def test_layer_ranges_cover_each_layer_once_in_the_fewest_runs(layers: set[int]) -> None:
    runs = layer_ranges(layers)
    covered = [layer for run in runs for layer in run]
    assert covered == sorted(layers)
    # Runs never touch: two adjacent runs would have been one.
    assert all(a.stop < b.start for a, b in zip(runs, runs[1:], strict=False))
    assert all(len(run) > 0 for run in runs)


def _registration(
    positions: tuple[int, ...], grants: tuple[int, ...] = (9,), slices: Slices | None = None
) -> PushRegistration:
    blocks = tuple(100 + i for i in range(len(positions)))
    return PushRegistration("r", 4096, positions, blocks, grants, (0, 1), 5.0, slices)


def test_source_blocks_are_ps_blocks_at_ds_positions() -> None:
    assert source_blocks([(10, 11, 12, 13)], _registration((1, 3)), 1) == (11, 13)
    assert source_blocks([(10, 11)], _registration(()), 1) == ()


def test_source_blocks_of_several_groups_are_each_groups_own_never_the_null_block() -> None:
    """The hybrid KV-cache manager: D's positions come group by group; a sliding-window
    group's position P dropped from its window is refused, never written from the null
    block."""
    full, window = (10, 11, 12, 13), (NULL_BLOCK_ID, NULL_BLOCK_ID, 22, 23)
    both = replace(_registration((0, 1, 2, 3, 2, 3)), groups=(4, 2))
    assert source_blocks([full, window], both, 1) == (10, 11, 12, 13, 22, 23)
    with pytest.raises(ValueError, match="prompt block 1, which left P's window"):
        source_blocks([full, window], replace(_registration((0, 1)), groups=(1, 1)), 1)
    with pytest.raises(ValueError, match="blocks of 1 KV-cache group.s., this engine has 2"):
        source_blocks([full, window], _registration((0, 1)), 1)
    with pytest.raises(ValueError, match="blocks of 2 KV-cache group.s., this engine has 1"):
        source_blocks([full], both, 1)


# Two state groups (1 and 2) of 3 and 2 units a block, pages of 16 units.
STATE = StateLayout(
    (0,), 64 * 16, 256, ((1, (StatePart(0, 16, 3),)), (2, (StatePart(0, 16, 2),))), (), ()
)


def test_state_pairs_are_the_units_of_ps_slot_that_ds_runs_name() -> None:
    """P offers a state group's slot alone; D names, per state group, runs of units counted
    from the start of P's slot (the whole state, or D's slices of it between TP sizes) and
    where each lands in its own registration, and the tokens the state must hold: a state
    that holds another number is refused, and so is a run beyond P's state."""
    offered = SendSpec("r", 1, 0, 0, ((10, 11), (40,), (50,)), num_tokens=31)
    whole = (StateRun(1, 0, 7 * 16, 3), StateRun(2, 0, 8 * 16, 2))
    both = replace(_registration((0, 1)), groups=(2, 0, 0), state_runs=whole, num_tokens=31)
    src = [*range(40 * 16, 40 * 16 + 3), *range(50 * 16, 50 * 16 + 2)]
    dst = [*range(7 * 16, 7 * 16 + 3), *range(8 * 16, 8 * 16 + 2)]
    assert state_pairs(offered, both, STATE) == (src, dst)
    sliced = replace(both, state_runs=(StateRun(1, 1, 200, 2), StateRun(2, 1, 90, 1)))
    assert state_pairs(offered, sliced, STATE) == ([641, 642, 801], [200, 201, 90])
    assert state_pairs(offered, _registration((0, 1)), None) == ([], [])  # no state named
    with pytest.raises(ValueError, match="this engine's model has no state"):
        state_pairs(offered, both, None)
    with pytest.raises(ValueError, match="P's state holds 32 prompt tokens, D continues from 31"):
        state_pairs(replace(offered, num_tokens=32), both, STATE)  # P computed it whole
    with pytest.raises(ValueError, match="group 0 a state group; it is not one here"):
        state_pairs(offered, replace(both, state_runs=(StateRun(0, 0, 7, 1),)), STATE)
    with pytest.raises(ValueError, match="group 3 a state group"):
        state_pairs(offered, replace(both, state_runs=(StateRun(3, 0, 7, 1),)), STATE)
    with pytest.raises(ValueError, match="group 2 a state group"):  # D counts 2 groups
        state_pairs(offered, replace(both, groups=(2, 0)), STATE)
    with pytest.raises(ValueError, match="units 2 to 4 of the state of group 1, which holds 3"):
        state_pairs(offered, replace(both, state_runs=(StateRun(1, 2, 7, 2),)), STATE)
    with pytest.raises(ValueError, match="P holds no state slot of group 2"):
        state_pairs(replace(offered, block_ids=((10, 11), (40,), ())), both, STATE)
    with pytest.raises(ValueError, match="P holds no state slot of group 1"):
        state_pairs(replace(offered, block_ids=((10, 11), (NULL_BLOCK_ID,), (50,))), both, STATE)


@given(
    st.lists(st.lists(st.integers(1, 999), min_size=1, max_size=8), min_size=1, max_size=4),
    st.data(),
)
def test_source_blocks_pair_each_ds_block_with_ps_block_of_its_group_and_position(
    groups: list[list[int]], data: st.DataObject
) -> None:
    chosen = [data.draw(st.lists(st.integers(0, len(g) - 1), unique=True)) for g in groups]
    positions = tuple(p for picked in chosen for p in picked)
    registration = replace(_registration(positions), groups=tuple(len(c) for c in chosen))
    assert registration.group_positions() == tuple(tuple(c) for c in chosen)
    source = source_blocks([tuple(g) for g in groups], registration, 1)
    assert source == tuple(g[p] for g, picked in zip(groups, chosen, strict=True) for p in picked)


def test_smaller_source_blocks_are_ratio_per_position_null_past_the_prompt() -> None:
    halves = Slices(2, (SliceRun(0, 0, 0, 1),))
    prompt = (10, 11, 12, 13, 14)  # 5 of P's blocks: D's position 2 holds only the last
    assert source_blocks([prompt], _registration((0, 2), slices=halves), 3) == (
        10,
        11,
        14,
        NULL_BLOCK_ID,
    )
    with pytest.raises(ValueError, match="prompt block 6, the prompt has 5"):
        source_blocks([prompt], _registration((3,), slices=halves), 1)
    with pytest.raises(ValueError, match="granted 2 KV caches, this engine registers 1"):
        source_blocks([prompt], _registration((0,), (1, 2), halves), 1)


@given(
    st.integers(2, 4),
    st.integers(1, 3),
    st.integers(1, 3),
    st.data(),
    st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True),
    st.randoms(use_true_random=False),
)
def test_pushed_slices_rebuild_each_head_of_ds_block_from_ps_blocks(
    ratio: int, p_units: int, head_slices: int, data: Any, dst: list[int], rng: Any
) -> None:
    """Whatever runs D names (here: a random shuffle of every slice of the ``ratio`` parts),
    each slice of the heads of ``run`` of a P block lands once, in the matching head of the
    D block it belongs to."""
    d_units = data.draw(st.integers(1, 3))
    count = data.draw(st.integers(1, min(p_units, d_units)))
    run = HeadRun(
        data.draw(st.integers(0, p_units - count)),
        data.draw(st.integers(0, d_units - count)),
        count,
    )
    origins = [(part, s) for part in range(ratio) for s in range(head_slices)]
    rng.shuffle(origins)  # D slice i comes from origins[i]
    runs = tuple(SliceRun(part, s, i, 1) for i, (part, s) in enumerate(origins))
    src = [1000 + i for i in range(ratio * len(dst))]
    src[-1] = NULL_BLOCK_ID  # the prompt ends in the last D block's first parts
    moved = pushed_slices(src, dst, Slices(ratio, runs), (run,), (p_units, d_units), head_slices)
    pairs = set(zip(*moved, strict=True))
    expected = set()
    for i, d_block in enumerate(dst):
        for h in range(count):
            p_head, d_head = run.src + h, run.dst + h
            for d_slice, (part, s) in enumerate(origins):
                p_block = src[i * ratio + part]
                if p_block != NULL_BLOCK_ID:
                    expected.add(
                        (
                            (p_block * p_units + p_head) * head_slices + s,
                            (d_block * d_units + d_head) * head_slices * ratio + d_slice,
                        )
                    )
    assert pairs == expected and len(moved[0]) == len(expected)


def test_pushed_slices_refuse_runs_that_leave_a_head() -> None:
    whole = (HeadRun(0, 0, 1),)
    with pytest.raises(ValueError, match="leaves a KV head of 4 slices here, 8 there"):
        pushed_slices([1, 2], [3], Slices(2, (SliceRun(1, 3, 0, 2),)), whole, (1, 1), 4)
    with pytest.raises(ValueError, match="leaves a KV head"):
        pushed_slices([1, 2], [3], Slices(2, (SliceRun(1, 0, 7, 2),)), whole, (1, 1), 4)


def _valid(heads: int, p_tp: int, d_tp: int) -> bool:
    try:
        check_tp_pair(heads, p_tp, d_tp)
    except TPMismatch:
        return False
    return True


VALID_TP = [
    (heads, p_tp, d_tp)
    for heads in (1, 2, 4, 8)
    for p_tp in (1, 2, 4, 8)
    for d_tp in (1, 2, 4, 8)
    if _valid(heads, p_tp, d_tp)
]


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), VALID_TP)
def test_every_d_rank_is_pushed_each_of_its_heads_once_by_a_p_rank_holding_it(
    heads: int, p_tp: int, d_tp: int
) -> None:
    """D's plan (the heads a pull would read, by P rank) as registrations, P's writes of
    them: every KV head of every D rank comes once, from the same global head on P; and
    every P rank hears from exactly the number of D ranks each registration says."""
    p_units, d_units = heads_per_rank(heads, p_tp), heads_per_rank(heads, d_tp)
    heard: dict[int, list[int]] = {p: [] for p in range(p_tp)}
    for d_rank in range(d_tp):
        plan = plan_rank(heads, p_tp, d_tp, d_rank)
        written: list[int] = []
        for p_rank in plan.notify:
            runs = tuple(HeadRun(r.src_head, r.dst_head, r.count) for r in plan.reads_from(p_rank))
            heard[p_rank].append(plan.consumers[p_rank])
            if not runs:
                continue  # a replica nobody reads: registered with no blocks, it is done
            registration = PushRegistration(
                "r",
                1,
                (0,),
                (7,),
                (9,),
                (0, 1),
                5.0,
                None,
                runs,
                d_units,
                d_rank,
                plan.consumers[p_rank],
            )
            checked, units = head_runs(registration, p_units)
            src, dst = pushed_units([3], [7], checked, (p_units, units))
            for s_unit, d_unit in zip(src, dst, strict=True):
                p_head = first_head(heads, p_tp, p_rank) + s_unit - 3 * p_units
                d_head = first_head(heads, d_tp, d_rank) + d_unit - 7 * d_units
                assert p_head == d_head
                written.append(d_unit - 7 * d_units)
        assert sorted(written) == list(range(d_units))
    for p_rank, consumers in heard.items():
        assert consumers and all(c == len(consumers) for c in consumers), (p_rank, consumers)


def test_head_runs_refuse_a_run_beyond_a_block() -> None:
    registration = PushRegistration(
        "r", 1, (0,), (7,), (9,), (0, 1), 5.0, None, (HeadRun(1, 0, 1),), 2
    )
    assert head_runs(registration, 2) == ((HeadRun(1, 0, 1),), 2)
    with pytest.raises(ValueError, match="leaves a block of 1 KV heads here, 2 there"):
        head_runs(registration, 1)
    every = PushRegistration("r", 1, (0,), (7,), (9,), (0, 1), 5.0)
    assert head_runs(every, 3) == ((HeadRun(0, 0, 3),), 3)


def test_source_blocks_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="prompt block 4, the prompt has 4"):
        source_blocks([(10, 11, 12, 13)], _registration((0, 4)), 1)
    with pytest.raises(ValueError, match="granted 1 KV caches, this engine registers 2"):
        source_blocks([(10, 11)], _registration((0,)), 2)


def test_serial_jobs_run_in_order_one_at_a_time_beside_other_queues() -> None:
    done: dict[str, list[int]] = {"a": [], "b": []}
    running = {"a": 0, "b": 0}
    overlap: list[str] = []
    lock = threading.Lock()

    def job(queue: str, i: int) -> None:
        with lock:
            running[queue] += 1
            if running[queue] > 1:
                overlap.append(queue)
        time.sleep(0.001)
        with lock:
            running[queue] -= 1
            done[queue].append(i)

    with ThreadPoolExecutor(4) as pool:
        queues = {name: SerialJobs(pool) for name in done}
        for i in range(50):
            for name, queue in queues.items():
                queue.submit(partial(job, name, i))
        deadline = time.monotonic() + 10
        while any(len(v) < 50 for v in done.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert done == {"a": list(range(50)), "b": list(range(50))}
    assert overlap == []


def test_serial_jobs_refuse_once_the_pool_shut_down() -> None:
    pool = ThreadPoolExecutor(1)
    jobs = SerialJobs(pool)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        jobs.submit(lambda: None)


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.randoms(use_true_random=False),
)
def test_a_shared_buffer_is_computed_once_every_layer_in_it_was(
    owners: list[int], rng: Any
) -> None:
    """Layer names mapped onto registered layers (several names a layer: the hybrid
    manager's shared buffers), computed in any order, some twice: each registered layer is
    reported once, when its last name is computed, never before."""
    layers = {f"layer.{i}": layer for i, layer in enumerate(owners)}
    computed = ComputedLayers(layers)
    computed.begin()
    names = list(layers) + rng.sample(list(layers), k=min(3, len(layers))) + ["not.registered"]
    rng.shuffle(names)
    seen: set[str] = set()
    reported = []
    for name in names:
        layer = computed.computed(name)
        seen.add(name)
        names_of_layer = {n for n, owner in layers.items() if owner == layers.get(name)}
        if layer is not None:
            assert names_of_layer <= seen  # only once every name in it was computed
            reported.append(layer)
    assert sorted(reported) == sorted(set(owners))  # each exactly once
    assert computed.layers == set(owners)
    computed.begin()  # the next forward starts from nothing
    assert computed.layers == set()
