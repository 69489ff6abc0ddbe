"""D's scheduler half inside vLLM's real Scheduler (CPU, one process, no worker): what a
decode engine asks for, reads, renews and gives back.

The worker side is played by hand: each step the test returns a ModelRunnerOutput with the
KVConnectorOutput a worker would report (finished_recving, failed_recving, finished_sending).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm_harness import (
    BLOCK_SIZE,
    PREFILL,
    block_ids,
    decode_side,
    finished_outputs,
    free_blocks,
    group_block_ids,
    hixl,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prompt,
    run_until_finished,
    served_locally,
    step,
)

from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.metadata import ReleaseSpec, WaitingRead

pytestmark = pytest.mark.usefixtures("scheduling")


def test_remote_prefill_lifecycle(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    idle = free_blocks(scheduler)
    request = make_request("d1", prompt(40), params=prefill_params(3))
    scheduler.add_request(request)

    output, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert output.num_scheduled_tokens == {}
    meta = metadata(output)
    (spec,) = meta.to_recv
    assert (spec.request_id, spec.remote_request_id, spec.lease_id) == ("d1", "p-req", 77)
    assert spec.remote == PREFILL
    assert spec.local_block_ids == tuple(block_ids(scheduler, "d1"))
    assert len(spec.local_block_ids) == 3
    assert spec.remote_block_ids == (100, 101, 102)
    assert spec.error == ""
    assert meta.to_release == [] and meta.to_send == []
    # The workers renew its lease while it waits (they are told of changes only).
    assert meta.waiting == [WaitingRead("d1", PREFILL, "p-req", 77)] and meta.done_waiting == []
    assert request.kv_transfer_params["do_remote_prefill"] is False

    # Still waiting for the pull: no new RecvSpec, nothing new for the heartbeats.
    output, _ = step(scheduler, finished_recving={"d1"})
    assert output.num_scheduled_tokens == {}
    assert metadata(output).to_recv == []
    assert metadata(output).waiting == [] and metadata(output).done_waiting == []

    # Promoted: only the last prompt token is recomputed, for its logits.
    output, _ = step(scheduler)
    assert request.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens == {"d1": 1}
    assert metadata(output).done_waiting == ["d1"]
    finished = run_until_finished(scheduler, "d1")
    assert finished.finish_reason == FinishReason.LENGTH
    assert free_blocks(scheduler) == idle
    assert len(decode_side(scheduler).waiting) == 0


def test_prefix_hit_pulls_only_the_suffix(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    shared = prompt(2 * BLOCK_SIZE)
    warm_blocks = served_locally(scheduler, "warm", shared + prompt(8, seed=1))

    request = make_request("d2", shared + prompt(24, seed=2), params=prefill_params(4))
    scheduler.add_request(request)
    output, _ = step(scheduler)
    (spec,) = metadata(output).to_recv
    blocks = block_ids(scheduler, "d2")
    assert blocks[:2] == warm_blocks[:2]  # the local prefix-cache hit
    assert spec.local_block_ids == tuple(blocks[2:])
    assert spec.remote_block_ids == (102, 103)  # the suffix of P's 100..103

    step(scheduler, finished_recving={"d2"})
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"d2": 1}


def test_a_hybrid_model_with_a_local_prefix_hit_reads_each_groups_missing_blocks(
    tiny_model_dir: Path,
) -> None:
    """vLLM's hybrid KV-cache manager (full attention and a sliding window), D holding the
    prompt's first blocks in its own prefix cache: the read fills, group by group, the blocks
    vLLM allocated past the hit, from P's blocks at the same positions; the sliding-window
    positions vLLM left null (behind the window) are not read."""
    scheduler = make_scheduler(
        tiny_model_dir, "kv_consumer", sliding_window=2 * BLOCK_SIZE, num_blocks=128
    )
    shared = prompt(4 * BLOCK_SIZE)
    warm_blocks = served_locally(scheduler, "warm", shared + prompt(8, seed=1))
    full, window = list(range(100, 108)), [0, 0, 0, *range(203, 208)]  # P's window dropped 0-2
    params = prefill_params(8, remote_block_ids=[full, window])
    scheduler.add_request(
        make_request("hma", shared + prompt(4 * BLOCK_SIZE - 4, 2), params=params)
    )
    output, _ = step(scheduler)
    (spec,) = metadata(output).to_recv
    full_blocks, window_blocks = group_block_ids(scheduler, "hma")
    assert full_blocks[:4] == warm_blocks[:4]  # the local prefix-cache hit
    read = [p for p in range(4, 8) if window_blocks[p] != NULL_BLOCK_ID]
    assert read and read != list(range(4, 8))  # the window left some positions null
    assert spec.local_block_ids == (*full_blocks[4:], *(window_blocks[p] for p in read))
    assert spec.remote_block_ids == (*full[4:], *(window[p] for p in read))

    step(scheduler, finished_recving={"hma"})
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"hma": 1}


def test_no_external_tokens_releases_without_pull(tiny_model_dir: Path) -> None:
    # vLLM drops the external tokens of a request that skips cache reads (prompt logprobs):
    # update_state_after_alloc sees num_external_tokens == 0.
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    request = make_request(
        "d3", prompt(40), params=prefill_params(3), skip_reading_prefix_cache=True
    )
    scheduler.add_request(request)
    output, _ = step(scheduler)
    meta = metadata(output)
    assert meta.to_recv == []
    assert meta.to_release == [ReleaseSpec("d3", "p-req", 77, PREFILL)]
    assert meta.waiting == [] and meta.done_waiting == []  # began and ended in one step
    assert output.num_scheduled_tokens == {"d3": 40}


def test_full_local_hit_releases_without_pull(tiny_model_dir: Path) -> None:
    # vLLM 0.32 caps a local hit at num_tokens - 1, so schedule() never asks about a full
    # hit; the hook is driven directly, with real KVCacheBlocks, then shipped by schedule().
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    connector = hixl(scheduler)
    request = make_request("d4", prompt(32), params=prefill_params(2))
    connector.on_new_request(request)
    assert connector.get_num_new_matched_tokens(request, 32) == (0, False)
    for _ in range(2):  # side-effect free
        assert connector.get_num_new_matched_tokens(request, 16) == (16, True)
    blocks = scheduler.kv_cache_manager.empty_kv_cache_blocks
    connector.update_state_after_alloc(request, blocks, 0)
    connector.update_state_after_alloc(request, blocks, 0)  # one transfer per request
    meta = metadata(scheduler.schedule())
    assert meta.to_release == [ReleaseSpec("d4", "p-req", 77, PREFILL)]
    assert meta.to_recv == [] and meta.waiting == [] and meta.done_waiting == []


def _failed_read(tiny_model_dir: Path, policy: str) -> tuple[Scheduler, int, dict[str, Any]]:
    """A 40-token request whose read the worker reports failed under ``policy``: the
    scheduler, its free blocks before the request, and the requests finished in that step."""
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy=policy)
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("d5", prompt(40), params=prefill_params(3)))
    step(scheduler)
    _, engine_outputs = step(scheduler, failed_recving={"d5"})
    return scheduler, idle, finished_outputs(engine_outputs)


def test_failed_recving_recompute(tiny_model_dir: Path) -> None:
    scheduler, idle, finished = _failed_read(tiny_model_dir, "recompute")
    assert "d5" not in finished
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"d5": 40}  # the whole prompt, computed locally
    assert metadata(output).to_recv == []  # and no second pull
    assert run_until_finished(scheduler, "d5").finish_reason == FinishReason.LENGTH
    assert free_blocks(scheduler) == idle


def test_failed_recving_fail(tiny_model_dir: Path) -> None:
    scheduler, idle, finished = _failed_read(tiny_model_dir, "fail")
    assert finished["d5"].finish_reason == FinishReason.ERROR
    assert "d5" not in scheduler.requests
    assert free_blocks(scheduler) == idle


def test_abort_before_alloc_releases_and_heartbeats_while_unallocated(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", num_blocks=6)
    first = make_request(
        "a", prompt(64), params=prefill_params(4, remote_request_id="p-a", remote_lease_id=1)
    )
    second = make_request(
        "b",
        prompt(48, seed=3),
        params=prefill_params(3, remote_request_id="p-b", remote_lease_id=2),
    )
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = step(scheduler)
    meta = metadata(output)
    assert [spec.request_id for spec in meta.to_recv] == ["a"]  # no room for b yet
    assert second.status == RequestStatus.WAITING
    assert meta.waiting == [
        WaitingRead("a", PREFILL, "p-a", 1),
        WaitingRead("b", PREFILL, "p-b", 2),
    ]

    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    meta = metadata(scheduler.schedule())
    assert meta.to_release == [ReleaseSpec("b", "p-b", 2, PREFILL)]
    assert meta.waiting == [] and meta.done_waiting == ["b"]  # a still waits


def test_unusable_params_are_refused_not_recomputed(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy="fail")
    params = prefill_params(3)
    del params["remote_lease_id"]
    scheduler.add_request(make_request("d7", prompt(40), params=params))
    output, _ = step(scheduler)
    (spec,) = metadata(output).to_recv
    assert "remote_lease_id" in spec.error
    assert spec.remote_block_ids == () and len(spec.local_block_ids) == 3
    assert metadata(output).waiting == [] and metadata(output).done_waiting == []
    _, engine_outputs = step(scheduler, failed_recving={"d7"})
    assert finished_outputs(engine_outputs)["d7"].finish_reason == FinishReason.ERROR


def test_prefill_with_fewer_blocks_than_needed_is_refused(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    scheduler.add_request(make_request("d8", prompt(40), params=prefill_params(2)))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    assert "computed 32 tokens, this prompt needs 40" in spec.error
    assert spec.remote == PREFILL and spec.remote_block_ids == ()  # worker still releases P
    params = prefill_params(2, remote_num_tokens=None)  # no token count: the block list decides
    scheduler.add_request(make_request("d9", prompt(40, 3), params=params))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    assert "offers only 2" in spec.error and spec.remote_block_ids == ()


def test_smaller_prefill_blocks_fill_each_decode_block_in_order(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    # 40 tokens: three 16-token blocks here, five 8-token blocks on P.
    params = prefill_params(5, remote_block_size=[BLOCK_SIZE // 2])
    scheduler.add_request(make_request("d10", prompt(40), params=params))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    assert spec.error == "" and spec.blocks_per_block == 2
    assert len(spec.local_block_ids) == 3
    assert spec.remote_block_ids == (100, 101, 102, 103, 104, 0)  # the prompt ends in block 3

    params = prefill_params(4, remote_block_size=[BLOCK_SIZE // 2], remote_num_tokens=None)
    scheduler.add_request(make_request("d11", prompt(40, 1), params=params))
    (spec,) = metadata(step(scheduler)[0]).to_recv
    assert "offers 4 blocks of 8 tokens for a 40-token prompt" in spec.error


def test_larger_or_non_dividing_prefill_blocks_are_refused(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    for i, size in enumerate((2 * BLOCK_SIZE, 12)):
        params = prefill_params(3, remote_block_size=[size])
        scheduler.add_request(make_request(f"d{20 + i}", prompt(40, i), params=params))
        (spec,) = metadata(step(scheduler)[0]).to_recv
        assert f"prefill block_size [{size}], decode block_size [{BLOCK_SIZE}]" in spec.error
        assert spec.remote == PREFILL and spec.remote_block_ids == ()  # P is told to free


def test_abort_while_pulling_keeps_blocks_until_the_pull_ends(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("d9", prompt(40), params=prefill_params(3)))
    step(scheduler)
    scheduler.finish_requests("d9", RequestStatus.FINISHED_ABORTED)
    meta = metadata(scheduler.schedule())
    # The RecvSpec is already out: the worker skips the read if it has not begun, tells P,
    # and reports the request either way.
    assert meta.done_waiting == ["d9"] and meta.to_release == [] and meta.to_recv == []
    assert meta.to_cancel == ["d9"]
    assert free_blocks(scheduler) == idle - 3  # the pull may still write them
    step(scheduler, finished_recving={"d9"})
    assert free_blocks(scheduler) == idle
    assert scheduler.requests == {}


@pytest.mark.parametrize("mode", ["pull", "abort"])
def test_a_requests_params_are_parsed_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Every hook after the first reads the one parsed record (its first hook parses)."""
    from hixl_connector.connector.scheduler import decode_side as module

    parses: list[str] = []
    real = module.parse_remote_prefill

    def counted(params: dict) -> object:
        parses.append(params["remote_request_id"])
        return real(params)

    monkeypatch.setattr(module, "parse_remote_prefill", counted)
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer")
    request = make_request("d1", prompt(40), params=prefill_params(3))
    scheduler.add_request(request)
    if mode == "abort":  # finished before its blocks were allocated: P is told to free
        scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        output, _ = step(scheduler)
        assert [spec.request_id for spec in metadata(output).to_release] == ["d1"]
    else:
        output, _ = step(scheduler)
        assert [spec.request_id for spec in metadata(output).to_recv] == ["d1"]
        step(scheduler, finished_recving={"d1"})
        run_until_finished(scheduler, "d1")
    assert parses == ["p-req"]
    assert decode_side(scheduler)._asked == {}
