"""The pure parts of P's request push: which layers go in which write, which of P's blocks
D's registration names, and the in-order queue every request's writes run on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.peers.push_registration import PushRegistration, Slices
from hixl_connector.connector.worker.request_push import (
    layer_ranges,
    pushed_slices,
    source_blocks,
)
from hixl_connector.connector.worker.serial_jobs import SerialJobs


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
    assert source_blocks((10, 11, 12, 13), _registration((1, 3)), 1) == (11, 13)
    assert source_blocks((10, 11), _registration(()), 1) == ()


def test_smaller_source_blocks_are_ratio_per_position_null_past_the_prompt() -> None:
    halves = Slices(2, (SliceRun(0, 0, 0, 1),))
    prompt = (10, 11, 12, 13, 14)  # 5 of P's blocks: D's position 2 holds only the last
    assert source_blocks(prompt, _registration((0, 2), slices=halves), 3) == (
        10,
        11,
        14,
        NULL_BLOCK_ID,
    )
    with pytest.raises(ValueError, match="prompt block 6, the prompt has 5"):
        source_blocks(prompt, _registration((3,), slices=halves), 1)
    with pytest.raises(ValueError, match="granted 2 KV caches, this engine registers 1"):
        source_blocks(prompt, _registration((0,), (1, 2), halves), 1)


@given(
    st.integers(2, 4),
    st.integers(1, 3),
    st.integers(1, 4),
    st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True),
    st.randoms(use_true_random=False),
)
def test_pushed_slices_rebuild_each_head_of_ds_block_from_ps_blocks(
    ratio: int, heads: int, head_slices: int, dst: list[int], rng: Any
) -> None:
    """Whatever runs D names (here: a random shuffle of every slice of the ``ratio`` parts),
    each slice of a P block lands once, in the same head of the D block it belongs to."""
    origins = [(part, s) for part in range(ratio) for s in range(head_slices)]
    rng.shuffle(origins)  # D slice i comes from origins[i]
    runs = tuple(SliceRun(part, s, i, 1) for i, (part, s) in enumerate(origins))
    src = [1000 + i for i in range(ratio * len(dst))]
    src[-1] = NULL_BLOCK_ID  # the prompt ends in the last D block's first parts
    moved = pushed_slices(src, dst, Slices(ratio, runs), heads, head_slices)
    pairs = set(zip(*moved, strict=True))
    expected = set()
    for i, d_block in enumerate(dst):
        for head in range(heads):
            for d_slice, (part, s) in enumerate(origins):
                p_block = src[i * ratio + part]
                if p_block != NULL_BLOCK_ID:
                    expected.add(
                        (
                            (p_block * heads + head) * head_slices + s,
                            (d_block * heads + head) * head_slices * ratio + d_slice,
                        )
                    )
    assert pairs == expected and len(moved[0]) == len(expected)


def test_pushed_slices_refuse_runs_that_leave_a_head() -> None:
    with pytest.raises(ValueError, match="leaves a KV head of 4 slices here, 8 there"):
        pushed_slices([1, 2], [3], Slices(2, (SliceRun(1, 3, 0, 2),)), 1, 4)
    with pytest.raises(ValueError, match="leaves a KV head"):
        pushed_slices([1, 2], [3], Slices(2, (SliceRun(1, 0, 7, 2),)), 1, 4)


def test_source_blocks_refuse_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="prompt block 4, the prompt has 4"):
        source_blocks((10, 11, 12, 13), _registration((0, 4)), 1)
    with pytest.raises(ValueError, match="granted 1 KV caches, this engine registers 2"):
        source_blocks((10, 11), _registration((0,)), 2)


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
