"""Push mode in vLLM's real Scheduler (CPU, one process, no worker): what D asks P to write
when the router names P only, what P hands its workers, and what each side refuses.

The worker side is played by hand, as in test_decode_scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm_harness import (
    BLOCK_SIZE,
    PUSH_IDENTITY,
    PUSH_MODE,
    block_ids,
    finished_outputs,
    free_blocks,
    group_block_ids,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prompt,
    run_until_finished,
    runner_output,
    step,
)

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.metadata import PromptBlocks, PushRecvSpec
from hixl_connector.connector.transfer_params import (
    InvalidTransferParams,
    base_request_id,
    is_push_identity,
    parse_push_identity,
    parse_remote_prefill,
)

pytestmark = pytest.mark.usefixtures("scheduling")

P_ENDPOINT = RemoteEndpoint("prefill-engine", "10.0.0.9", 7100, 1, 0, 0)


def test_base_request_id_strips_vllms_random_suffix_only() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("chatcmpl-xyz-DEADBEEF") == "chatcmpl-xyz"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-1a2b3c4") == "cmpl-abc-1a2b3c4"


def test_identity_params_parse_and_bad_ones_name_the_field() -> None:
    assert is_push_identity(PUSH_IDENTITY)
    assert not is_push_identity(prefill_params(2))
    assert parse_push_identity(PUSH_IDENTITY) == P_ENDPOINT
    for key, bad in (("remote_port", 0), ("remote_host", ""), ("tp_size", "1")):
        with pytest.raises(InvalidTransferParams, match=key):
            parse_push_identity({**PUSH_IDENTITY, key: bad})
    # P's full answer in push mode (the router's first, sequential leg) is pulled.
    assert parse_remote_prefill(prefill_params(2, transfer_mode="push")).lease_id == 77
    with pytest.raises(InvalidTransferParams, match="transfer_mode"):
        parse_remote_prefill(prefill_params(2, transfer_mode="write"))


def test_concurrent_leg_registers_ds_blocks_and_waits_for_p(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", extra=PUSH_MODE)
    idle = free_blocks(scheduler)
    request = make_request(
        "cmpl-x-0-0badcafe", prompt(3 * BLOCK_SIZE + 5), params=dict(PUSH_IDENTITY)
    )
    scheduler.add_request(request)

    output, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = metadata(output)
    assert meta.to_recv == [] and meta.waiting == []  # no lease to read or renew
    (spec,) = meta.to_push_recv
    assert spec == PushRecvSpec(
        "cmpl-x-0-0badcafe",
        "cmpl-x-0",
        P_ENDPOINT,
        (0, 1, 2, 3),
        tuple(block_ids(scheduler, "cmpl-x-0-0badcafe")),
        (4,),
    )
    output, _ = step(scheduler, finished_recving={"cmpl-x-0-0badcafe"})
    assert metadata(output).to_push_recv == []
    finished = run_until_finished(scheduler, "cmpl-x-0-0badcafe")
    assert finished.finish_reason == FinishReason.LENGTH
    assert free_blocks(scheduler) == idle


def test_aborted_while_p_writes_is_cancelled_and_before_allocation_releases_p(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", extra=PUSH_MODE)
    scheduler.add_request(make_request("d1", prompt(40), params=dict(PUSH_IDENTITY)))
    step(scheduler)
    scheduler.finish_requests(["d1"], RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert metadata(output).to_cancel == ["d1"]

    # Aborted before it had blocks: P is told to free its own (a spec without blocks).
    scheduler.add_request(make_request("d2-00000000", prompt(40), params=dict(PUSH_IDENTITY)))
    scheduler.finish_requests(["d2-00000000"], RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler, finished_recving={"d1"})
    (spec,) = metadata(output).to_push_recv
    assert (spec.base_request_id, spec.positions, spec.local_block_ids) == ("d2", (), ())


def test_pull_mode_d_refuses_identity_params(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    scheduler.add_request(make_request("d1", prompt(40), params=dict(PUSH_IDENTITY)))
    output, _ = step(scheduler)
    meta = metadata(output)
    assert meta.to_push_recv == []
    (spec,) = meta.to_recv
    assert "remote_block_ids" in spec.error


def test_push_mode_p_hands_its_workers_the_prompt_blocks_and_names_the_mode(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", extra=PUSH_MODE)
    # What the router sends P in a concurrent leg.
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        **dict.fromkeys(("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")),
    }
    scheduler.add_request(
        make_request("p1", prompt(2 * BLOCK_SIZE + 3), max_tokens=1, params=params)
    )
    output = scheduler.schedule()
    blocks = block_ids(scheduler, "p1")
    # The step computes the whole prompt: its workers write each layer as it is computed.
    assert metadata(output).prefilling == [PromptBlocks("p1", (tuple(blocks[:3]),))]
    finished = finished_outputs(scheduler.update_from_output(output, runner_output(output)))
    answer = finished["p1"].kv_transfer_params
    assert answer["transfer_mode"] == "push"
    assert answer["remote_engine_id"] == "engine-under-test"
    assert answer["remote_host"] and answer["remote_port"] and answer["tp_size"] == 1
    (send,) = metadata(step(scheduler)[0]).to_send
    assert send.block_ids == (tuple(blocks[:3]),)


def test_push_mode_p_names_the_prompts_that_end_without_a_lease(tiny_model_dir: Path) -> None:
    """A prompt aborted while P computes it, or before, gets no lease: the workers are told,
    so that a D registered for it hears that nothing comes. One that leased is not named,
    and a pull-mode P names none."""
    params = {"do_remote_decode": True}
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", extra=PUSH_MODE)
    for request_id in ("running", "leased"):
        scheduler.add_request(
            make_request(request_id, prompt(2 * BLOCK_SIZE + 3), max_tokens=1, params=params)
        )
    output = scheduler.schedule()
    scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, runner_output(output))
    output, _ = step(scheduler)
    assert metadata(output).not_pushed == ["running"]
    assert [send.request_id for send in metadata(output).to_send] == ["leased"]
    assert metadata(step(scheduler)[0]).not_pushed == []
    scheduler.add_request(make_request("queued", prompt(40), params=params))
    scheduler.finish_requests(["queued"], RequestStatus.FINISHED_ABORTED)
    assert metadata(step(scheduler)[0]).not_pushed == ["queued"]

    pulling = make_scheduler(tiny_model_dir, "kv_producer")
    pulling.add_request(make_request("p", prompt(40), params=params))
    pulling.schedule()
    pulling.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert metadata(pulling.schedule()).not_pushed == []


def test_a_hybrid_d_registers_each_groups_blocks_the_window_only_where_it_attends(
    tiny_model_dir: Path,
) -> None:
    """vLLM's hybrid KV-cache manager (full attention and a sliding window): D asks P for
    every block of the full group and, of the sliding-window group, only the blocks still
    in its window, group by group, and says how many are in each."""
    scheduler = make_scheduler(
        tiny_model_dir,
        "kv_consumer",
        extra=PUSH_MODE,
        sliding_window=2 * BLOCK_SIZE,
        num_blocks=128,
    )
    request_id = "cmpl-h-0-0badcafe"
    scheduler.add_request(
        make_request(request_id, prompt(6 * BLOCK_SIZE + 5), params=dict(PUSH_IDENTITY))
    )
    output, _ = step(scheduler)
    (spec,) = metadata(output).to_push_recv
    full, window = group_block_ids(scheduler, request_id)
    attended = [p for p, block in enumerate(window) if block != NULL_BLOCK_ID]
    assert attended and len(attended) < len(window)  # the window left some positions null
    assert spec.groups == (len(full), len(attended))
    assert spec.positions == (*range(len(full)), *attended)
    assert spec.local_block_ids == (*full, *(window[p] for p in attended))


def test_a_hybrid_p_hands_its_workers_each_groups_prompt_blocks(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(
        tiny_model_dir,
        "kv_producer",
        extra=PUSH_MODE,
        sliding_window=2 * BLOCK_SIZE,
        num_blocks=128,
    )
    scheduler.add_request(
        make_request(
            "p1",
            prompt(4 * BLOCK_SIZE + 3),
            max_tokens=1,
            params={"do_remote_decode": True, "do_remote_prefill": False},
        )
    )
    output = scheduler.schedule()
    blocks = tuple(tuple(group[:5]) for group in group_block_ids(scheduler, "p1"))
    # The forward computes every block of both groups, so every one can be written.
    assert metadata(output).prefilling == [PromptBlocks("p1", blocks)]
    assert NULL_BLOCK_ID not in blocks[1]
    scheduler.update_from_output(output, runner_output(output))
    (send,) = metadata(step(scheduler)[0]).to_send
    assert len(send.block_ids) == 2 and send.block_ids[0] == blocks[0]
