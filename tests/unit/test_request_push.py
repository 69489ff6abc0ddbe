"""The pure parts of P's request push: which layers go in which write, which of P's blocks
D's registration names, and the in-order queue every request's writes run on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.peers.push_registration import PushRegistration
from hixl_connector.connector.worker.request_push import layer_ranges, source_blocks
from hixl_connector.connector.worker.serial_jobs import SerialJobs


@given(st.sets(st.integers(0, 80)))
def test_layer_ranges_cover_each_layer_once_in_the_fewest_runs(layers: set[int]) -> None:
    runs = layer_ranges(layers)
    covered = [layer for run in runs for layer in run]
    assert covered == sorted(layers)
    # Runs never touch: two adjacent runs would have been one.
    assert all(a.stop < b.start for a, b in zip(runs, runs[1:], strict=False))
    assert all(len(run) > 0 for run in runs)


def _registration(positions: tuple[int, ...], grants: tuple[int, ...] = (9,)) -> PushRegistration:
    blocks = tuple(100 + i for i in range(len(positions)))
    return PushRegistration("r", 4096, positions, blocks, grants, (0, 1), 5.0)


def test_source_blocks_are_ps_blocks_at_ds_positions() -> None:
    assert source_blocks((10, 11, 12, 13), _registration((1, 3)), 1) == (11, 13)
    assert source_blocks((10, 11), _registration(()), 1) == ()


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
