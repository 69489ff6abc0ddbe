"""A hybrid state model under vLLM's own scheduler (layer 0 full attention, layer 1 a Mamba2
state without prefix caching): P computes the prompt but its last token, once even when
preempted, and offers its state slot; D loads that many tokens and the state slot, then
computes the last token itself; what cannot be the state D continues from is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm_harness import (
    BLOCK_SIZE,
    PUSH_IDENTITY,
    PUSH_MODE,
    finished_outputs,
    free_blocks,
    group_block_ids,
    hixl,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prompt,
    runner_output,
    step,
)

from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS


@pytest.fixture(autouse=True, params=["none", "align"])
def cache_mode(request: pytest.FixtureRequest) -> str:
    """Each test without prefix caching of the state (one slot) and with it (a slot per
    block, the state at the block of the last token)."""
    global MODE
    MODE = request.param
    return MODE


MODE = "none"


def state_position(tokens: int) -> int:
    """Where the state after ``tokens`` tokens sits in a row (state_groups.state_slot)."""
    return 0 if MODE == "none" else (tokens - 1) // BLOCK_SIZE


def remote_decode(request_id: str, tokens: int, **sampling: object) -> Any:
    return make_request(
        request_id, prompt(tokens), max_tokens=4, params=dict(PREFILL_LEG_PARAMS), **sampling
    )


def prefill(scheduler: Scheduler, request_id: str, steps: int = 6) -> tuple[int, Any, list]:
    """Steps until P finished the request: (tokens it scheduled, its last output, its blocks
    of each group as the last step left them)."""
    scheduled = 0
    for _ in range(steps):
        output = scheduler.schedule()
        scheduled += output.num_scheduled_tokens.get(request_id, 0)
        blocks = group_block_ids(scheduler, request_id)
        request = scheduler.requests[request_id]
        partial = set() if scheduled >= request.num_prompt_tokens else {request_id}
        finished = finished_outputs(
            scheduler.update_from_output(output, runner_output(output, partial=partial))
        )
        if request_id in finished:
            return scheduled, finished[request_id], blocks
    raise AssertionError(f"{request_id} did not finish in {steps} steps")


@pytest.mark.parametrize("tokens", [2, 16, 17, 40])
def test_p_computes_all_but_the_last_token_and_offers_its_state_slot(
    tiny_model_dir: Path, tokens: int
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="p-state", state=MODE)
    request = remote_decode("p1", tokens)
    scheduler.add_request(request)
    if MODE == "align" and hasattr(request, "truncate_block_hashes"):
        # vLLM 0.34 hashes blocks by a size of its own: no hash names the dropped token.
        assert len(request.block_hashes) == (tokens - 1) // BLOCK_SIZE
    scheduled, finished, (attention, state) = prefill(scheduler, "p1")
    assert scheduled == tokens - 1
    params = finished.kv_transfer_params
    # One token out (P's sample is never used), the state after the prompt but its last
    # token, its slot alone, and the attention blocks of those tokens.
    assert len(finished.new_token_ids) == 1
    assert params["remote_num_tokens"] == tokens - 1
    slot = state_position(tokens - 1)
    assert params["remote_block_ids"] == [
        attention[: -(-(tokens - 1) // BLOCK_SIZE)],
        state[slot : slot + 1],
    ]
    assert state[slot] != 0  # the state slot, never a null placeholder


def test_a_one_token_prompt_and_prompt_logprobs_are_computed_whole(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="p-state-1", state=MODE)
    scheduler.add_request(remote_decode("one", 1))
    scheduler.add_request(remote_decode("logprobs", 20, prompt_logprobs=1))
    for request_id, tokens in (("one", 1), ("logprobs", 20)):
        request = scheduler.requests[request_id]
        assert request.num_prompt_tokens == tokens and request.max_tokens == 4


def test_a_preempted_prompt_is_truncated_once(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(
        tiny_model_dir,
        "kv_producer",
        engine_id="p-state-2",
        state=MODE,
        max_num_batched_tokens=16,
    )
    request = remote_decode("p1", 40)
    scheduler.add_request(request)
    output = scheduler.schedule()  # the first chunk of the 39 tokens P computes
    assert output.num_scheduled_tokens == {"p1": 16}
    scheduler.update_from_output(output, runner_output(output, partial={"p1"}))
    scheduler._preempt_request(request, 0.0)  # as vLLM does when it runs out of blocks
    assert request.status == RequestStatus.PREEMPTED
    # Seen again (a vLLM that announces a resumed request anew): not truncated again.
    hixl(scheduler).on_new_request(request)
    assert request.num_prompt_tokens == 39
    scheduled = 0
    for _ in range(6):
        output = scheduler.schedule()
        scheduled += output.num_scheduled_tokens.get("p1", 0)
        last = scheduled >= 39
        outputs = scheduler.update_from_output(
            output, runner_output(output, partial=set() if last else {"p1"})
        )
        if last:
            break
    assert scheduled == 39
    assert finished_outputs(outputs)["p1"].kv_transfer_params["remote_num_tokens"] == 39


@pytest.mark.parametrize("tokens", [2, 17, 40])
def test_d_loads_all_but_the_last_token_with_ps_state_slot(
    tiny_model_dir: Path, tokens: int
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", state=MODE)
    loaded = tokens - 1
    params = prefill_params(-(-loaded // BLOCK_SIZE), remote_num_tokens=loaded)
    params["remote_block_ids"] = [params["remote_block_ids"][0], [7]]
    scheduler.add_request(make_request("d1", prompt(tokens), params=params))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    attention, state = group_block_ids(scheduler, "d1")
    assert spec.error == ""
    assert spec.local_block_ids == tuple(attention[: -(-loaded // BLOCK_SIZE)])
    assert spec.remote_block_ids == tuple(params["remote_block_ids"][0])
    assert spec.state_block_ids == ((1, 7, state[state_position(loaded)]),)
    # vLLM counts N-1 tokens as computed once they arrive, and computes the last itself.
    request = scheduler.requests["d1"]
    assert request.num_computed_tokens == loaded
    step(scheduler, finished_recving={"d1"})
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"d1": 1}


def test_d_refuses_a_state_that_holds_another_number_of_tokens(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", state=MODE)
    # A P that did not stop before the last token: its state already holds it.
    params = prefill_params(3, remote_num_tokens=40)
    params["remote_block_ids"] = [params["remote_block_ids"][0], [7]]
    scheduler.add_request(make_request("d2", prompt(40), params=params))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    assert "the state after 40 tokens" in spec.error and "after 39" in spec.error
    assert spec.remote_block_ids == () and spec.state_block_ids == ()


def test_d_computes_a_one_token_prompt_and_releases_p(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", state=MODE)
    params = prefill_params(1, remote_num_tokens=1)
    params["remote_block_ids"] = [params["remote_block_ids"][0], [7]]
    scheduler.add_request(make_request("d3", prompt(1), params=params))
    output, _ = step(scheduler)
    meta = metadata(output)
    assert meta.to_recv == [] and [r.request_id for r in meta.to_release] == ["d3"]
    assert output.num_scheduled_tokens == {"d3": 1}


@pytest.mark.parametrize("tokens", [2, 17, 40])
def test_a_pushed_d_registers_the_tokens_blocks_by_position_and_its_state_slot_apart(
    tiny_model_dir: Path, tokens: int
) -> None:
    """Push mode: D names the blocks of N-1 tokens by prompt position and its state slot by
    group (no position: P writes its own slot's state there)."""
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", state=MODE, extra=PUSH_MODE)
    request_id = "cmpl-s-0-0badcafe"
    scheduler.add_request(make_request(request_id, prompt(tokens), params=dict(PUSH_IDENTITY)))
    (spec,) = metadata(step(scheduler)[0]).to_push_recv
    attention, state = group_block_ids(scheduler, request_id)
    loaded = -(-(tokens - 1) // BLOCK_SIZE)
    assert spec.positions == tuple(range(loaded)) and spec.groups == (loaded, 0)
    assert spec.local_block_ids == tuple(attention[:loaded])
    assert spec.state_block_ids == ((1, state[state_position(tokens - 1)]),)
    assert spec.every_local_block == (*attention[:loaded], state[state_position(tokens - 1)])
    assert spec.num_tokens == tokens - 1  # P refuses a state that holds another number
    assert scheduler.requests[request_id].num_computed_tokens == tokens - 1
    step(scheduler, finished_recving={request_id})
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {request_id: 1}  # D computes the last token


def test_a_pushing_p_hands_its_workers_the_state_slot_of_the_truncated_prompt(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", state=MODE, extra=PUSH_MODE)
    scheduler.add_request(remote_decode("p1", 40))
    scheduled, _, blocks = prefill(scheduler, "p1")
    assert scheduled == 39
    (send,) = metadata(step(scheduler)[0]).to_send
    attention, state = blocks
    assert send.block_ids == (
        tuple(attention[: -(-39 // BLOCK_SIZE)]),
        (state[state_position(39)],),
    )
    assert send.num_tokens == 39  # the prompt's tokens P computed


@pytest.mark.usefixtures("scheduling")  # asynchronous too: 0.32's AsyncScheduler
def test_an_aborted_read_keeps_its_state_slot_until_the_read_ends(tiny_model_dir: Path) -> None:
    """No step rewrites the state slot a read may still land in: vLLM frees it, with the
    tokens' blocks, only once the worker reported the read, under either scheduler."""
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", state=MODE)
    idle = free_blocks(scheduler)

    def params() -> dict[str, Any]:
        offered = prefill_params(-(-39 // BLOCK_SIZE), remote_num_tokens=39)
        return {**offered, "remote_block_ids": [offered["remote_block_ids"][0], [7]]}

    scheduler.add_request(make_request("d4", prompt(40), params=params()))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    held = idle - free_blocks(scheduler)
    assert spec.state_block_ids and held >= len(spec.every_local_block)
    scheduler.finish_requests("d4", RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert metadata(output).to_cancel == ["d4"]
    # Another request, and more steps: none is given the blocks the read may write.
    scheduler.add_request(make_request("d5", prompt(40, 1), params=params()))
    for _ in range(3):
        step(scheduler)
    other = {block for group in group_block_ids(scheduler, "d5") for block in group}
    assert other and not other & set(spec.every_local_block)
    step(scheduler, finished_recving={"d4"})
    assert "d4" not in scheduler.requests
