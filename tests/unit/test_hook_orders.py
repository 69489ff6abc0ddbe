"""The scheduler half under the hook orders newer vLLM (0.33, 0.34) uses, driven through
vLLM's real Scheduler with the hooks called in those orders:

- a waiting request with nothing new is re-queued, so get_num_new_matched_tokens is asked
  again and again before allocation (it must change nothing);
- with deferred async loads an aborted request reaches request_finished without
  update_state_after_alloc ever running (it must leave nothing behind);
- after a worker fault a step's finished ids may be replayed a step late (harmless);
- on_new_request runs before the scheduler stores the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_harness import (
    PUSH_IDENTITY,
    PUSH_MODE,
    decode_side,
    free_blocks,
    hixl,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prefill_side,
    prompt,
    run_until_finished,
    step,
)

from hixl_connector.connector.scheduler.decode_side import DecodeSide
from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS

pytestmark = pytest.mark.usefixtures("scheduling")


def held(decode: DecodeSide) -> tuple[Any, ...]:
    """Everything D's side holds between hooks."""
    return (
        dict(decode.waiting),
        set(decode.receiving),
        dict(decode._asked),
        dict(decode.loads._chosen),
        list(decode._to_recv),
        list(decode._to_push_recv),
        list(decode._to_release),
        list(decode._to_cancel),
    )


def decode_waiting_for(model_dir: Path, push: bool) -> tuple[Scheduler, Request]:
    """D (in push mode or pull mode) with one request added that asks for remote KV."""
    scheduler = make_scheduler(model_dir, "kv_consumer", extra=PUSH_MODE if push else None)
    params = dict(PUSH_IDENTITY) if push else prefill_params(3)
    request = make_request("d1-0badcafe", prompt(40), params=params)
    scheduler.add_request(request)
    return scheduler, request


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_asking_for_matched_tokens_again_changes_nothing(tiny_model_dir: Path, mode: str) -> None:
    push = mode == "push"
    scheduler, request = decode_waiting_for(tiny_model_dir, push)
    request_id, params = request.request_id, dict(request.kv_transfer_params)
    connector, decode = hixl(scheduler), decode_side(scheduler)
    first = connector.get_num_new_matched_tokens(request, 0)
    before = held(decode)
    for _ in range(5):
        assert connector.get_num_new_matched_tokens(request, 0) == first
    assert held(decode) == before
    assert request.kv_transfer_params == params

    output, _ = step(scheduler)
    meta = metadata(output)
    assert [s.request_id for s in (meta.to_push_recv if push else meta.to_recv)] == [request_id]
    step(scheduler, finished_recving={request_id})
    run_until_finished(scheduler, request_id)
    assert scheduler.requests == {}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_finished_without_allocation_leaves_nothing_behind(tiny_model_dir: Path, mode: str) -> None:
    push = mode == "push"
    scheduler, request = decode_waiting_for(tiny_model_dir, push)
    request_id = request.request_id
    idle = free_blocks(scheduler)  # added, not yet allocated
    hixl(scheduler).get_num_new_matched_tokens(request, 0)  # asked, never allocated
    scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    meta = metadata(step(scheduler)[0])
    if push:  # P is told to free its own blocks: a spec without blocks
        (spec,) = meta.to_push_recv
        assert (spec.positions, spec.local_block_ids) == ((), ())
    else:
        assert [spec.request_id for spec in meta.to_release] == [request_id]
    assert meta.to_recv == [] and meta.to_cancel == []
    assert held(decode_side(scheduler)) == ({}, set(), {}, {}, [], [], [], [])
    assert free_blocks(scheduler) == idle and scheduler.requests == {}


def test_a_replayed_finished_recving_id_is_harmless(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("done", prompt(40), params=prefill_params(3)))
    step(scheduler)
    step(scheduler, finished_recving={"done"})
    run_until_finished(scheduler, "done")
    scheduler.add_request(make_request("waits", prompt(40, 2), params=prefill_params(3)))
    step(scheduler)
    decode = decode_side(scheduler)
    before = held(decode)

    # The finished request's id arrives again, a step late, straight to the connector.
    hixl(scheduler).update_connector_output(KVConnectorOutput(finished_recving={"done"}))
    assert held(decode) == before
    assert "waits" in decode.receiving and "waits" in decode.waiting
    step(scheduler, finished_recving={"waits"})
    run_until_finished(scheduler, "waits")
    assert free_blocks(scheduler) == idle


def test_a_replayed_finished_sending_id_frees_no_other_lease(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="prefill-1")
    prefill = prefill_side(scheduler)
    for request_id in ("first", "second"):
        scheduler.add_request(
            make_request(request_id, prompt(40), max_tokens=1, params=dict(PREFILL_LEG_PARAMS))
        )
        step(scheduler)
        if request_id == "first":
            step(scheduler, finished_sending={"first"})
    (slot,) = [lease[1] for lease in prefill.leased.values()]
    free_slots = list(prefill._free_slots)

    hixl(scheduler).update_connector_output(KVConnectorOutput(finished_sending={"first"}))
    assert list(prefill.leased) == ["second"] and prefill.leased["second"][1] == slot
    assert list(prefill._free_slots) == free_slots  # no slot freed twice


def test_on_new_request_before_the_request_is_stored(tiny_model_dir: Path) -> None:
    """vLLM 0.34 calls on_new_request before the scheduler stores the request (0.32 after):
    the hook reads only the request; a second call, as 0.32's add_request makes here, adds
    nothing."""
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    request = make_request("early", prompt(40), params=prefill_params(3))
    hixl(scheduler).on_new_request(request)
    decode = decode_side(scheduler)
    assert list(decode.waiting) == ["early"] and scheduler.requests == {}
    scheduler.add_request(request)
    meta = metadata(step(scheduler)[0])
    assert [read.request_id for read in meta.waiting] == ["early"]
    assert [spec.request_id for spec in meta.to_recv] == ["early"]
