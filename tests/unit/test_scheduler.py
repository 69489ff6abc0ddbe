"""HixlScheduler inside vLLM's real Scheduler (CPU, one process, no worker).

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
    EXTRA_CONFIG,
    P_INCARNATION,
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
    prefill_side,
    runner_output,
    served_locally,
    step,
)

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.leases.guarded_read import LeaseWords, lease_word, words_path
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.metadata import ReleaseSpec, RemoteEndpoint, SendSpec, WaitingRead
from hixl_connector.connector.peers.rank_addresses import rank_address
from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS

pytestmark = pytest.mark.usefixtures("scheduling")

PREFILL = RemoteEndpoint("prefill-engine", "10.0.0.9", 7100, 1, 8192, P_INCARNATION)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 300 + 3 for i in range(num_tokens)]


def run_until_finished(scheduler: Scheduler, request_id: str, max_steps: int = 20) -> Any:
    for _ in range(max_steps):
        _, engine_outputs = step(scheduler)
        finished = finished_outputs(engine_outputs)
        if request_id in finished:
            return finished[request_id]
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


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


def test_failed_recving_recompute(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy="recompute")
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("d5", prompt(40), params=prefill_params(3)))
    step(scheduler)
    _, engine_outputs = step(scheduler, failed_recving={"d5"})
    assert "d5" not in finished_outputs(engine_outputs)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"d5": 40}  # the whole prompt, computed locally
    assert metadata(output).to_recv == []  # and no second pull
    assert run_until_finished(scheduler, "d5").finish_reason == FinishReason.LENGTH
    assert free_blocks(scheduler) == idle


def test_failed_recving_fail(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy="fail")
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("d6", prompt(40), params=prefill_params(3)))
    step(scheduler)
    _, engine_outputs = step(scheduler, failed_recving={"d6"})
    assert finished_outputs(engine_outputs)["d6"].finish_reason == FinishReason.ERROR
    assert "d6" not in scheduler.requests
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
    assert "computed 32 tokens, this prompt has 40" in spec.error
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


def test_producer_lifecycle(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="prefill-1")
    config = HixlConfig.from_dict(EXTRA_CONFIG, "prefill-1")
    idle = free_blocks(scheduler)
    for request_id, seed in (("p1", 0), ("p2", 5)):
        scheduler.add_request(
            make_request(
                request_id, prompt(40, seed), max_tokens=1, params=dict(PREFILL_LEG_PARAMS)
            )
        )
    output = scheduler.schedule()
    blocks = {rid: block_ids(scheduler, rid) for rid in ("p1", "p2")}
    finished = finished_outputs(scheduler.update_from_output(output, runner_output(output)))
    assert set(finished) == {"p1", "p2"}
    leases = {rid: out.kv_transfer_params["remote_lease_id"] for rid, out in finished.items()}
    assert len(set(leases.values())) == 2
    params = dict(finished["p1"].kv_transfer_params)
    # vLLM itself adds P's local cache hits for D's usage report.
    assert params.pop("remote_prefill_cached_tokens") == 0
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_size": [16],
        "remote_block_ids": [blocks["p1"]],
        "remote_engine_id": "prefill-1",
        "remote_request_id": "p1",
        "remote_host": "10.0.0.7",
        "remote_port": 6100,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_cluster_id": rank_address(config, 0, 0, 1).cluster_id,
        "remote_lease_id": leases["p1"],
        "remote_lease_slot": 0,
        "remote_incarnation": prefill_side(scheduler).incarnation,
    }
    assert finished["p2"].kv_transfer_params["remote_lease_slot"] == 1
    assert rank_address(config, 0, 0, 1).cluster_id == 4096
    assert free_blocks(scheduler) == idle - 6  # delay-free: both requests keep 3 blocks

    output, _ = step(scheduler)
    assert metadata(output).to_send == [
        SendSpec(
            rid,
            leases[rid],
            slot,
            lease_word(leases[rid], [blocks[rid]], prefill_side(scheduler).incarnation),
        )
        for slot, rid in enumerate(("p1", "p2"))
    ]
    assert len(prefill_side(scheduler).leased) == 2
    step(scheduler, finished_sending={"p1"})
    assert free_blocks(scheduler) == idle - 3
    step(scheduler, finished_sending={"p2"})
    assert free_blocks(scheduler) == idle
    assert scheduler.requests == {} and len(prefill_side(scheduler).leased) == 0
    assert metadata(scheduler.schedule()).to_send == []


def test_a_lease_is_published_before_its_params_leave_and_its_slot_reused_after(
    tiny_model_dir: Path,
) -> None:
    words = LeaseWords.create(words_path("prefill-w", 0, 0), 64)  # as P's worker does
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="prefill-w")
    slots = []
    for request_id in ("p1", "p2"):
        params = dict(PREFILL_LEG_PARAMS)
        scheduler.add_request(make_request(request_id, prompt(40, 1), max_tokens=1, params=params))
        (out,) = finished_outputs(step(scheduler)[1]).values()
        sent = out.kv_transfer_params
        slot = sent["remote_lease_slot"]
        word = lease_word(
            sent["remote_lease_id"], sent["remote_block_ids"], sent["remote_incarnation"]
        )
        assert words[slot] == word  # D can check it as soon as it has the params
        assert words.incarnation == sent["remote_incarnation"]  # what P's handshake announces
        words.clear(slot, word)  # P's worker: cleared before it reports the lease ended
        step(scheduler, finished_sending={request_id})
        slots.append(slot)
    assert slots[0] == slots[1]  # freed once reported, and taken again
    words.close()


def test_producer_abort_frees_at_once(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer")
    idle = free_blocks(scheduler)
    scheduler.add_request(make_request("p3", prompt(40), params={"do_remote_decode": True}))
    scheduler.schedule()
    scheduler.finish_requests("p3", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(scheduler) == idle
    assert metadata(scheduler.schedule()).to_send == []


def test_producer_computes_a_remote_prefill_request_itself(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer")
    scheduler.add_request(make_request("x", prompt(40), params=prefill_params(3)))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"x": 40}
    assert metadata(output).to_recv == [] and metadata(output).waiting == []
    assert hixl(scheduler).get_finished_count() is None


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


def test_kv_both_serves_as_prefill_and_decode(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_both")
    scheduler.add_request(make_request("d", prompt(40), params=prefill_params(3)))
    scheduler.add_request(
        make_request("p", prompt(40, seed=9), max_tokens=1, params={"do_remote_decode": True})
    )
    output, engine_outputs = step(scheduler)
    assert [spec.request_id for spec in metadata(output).to_recv] == ["d"]
    assert output.num_scheduled_tokens == {"p": 40}
    params = finished_outputs(engine_outputs)["p"].kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "p"
    assert [spec.request_id for spec in metadata(step(scheduler)[0]).to_send] == ["p"]


def test_misconfigured_requests_are_counted_by_kind_and_said_once(
    tiny_model_dir: Path, caplog: Any
) -> None:
    """Requests that show a misconfigured deployment, through vLLM's real scheduler: counted
    by kind in the connector's stats, and each kind said once with its cause."""
    import logging

    logger = logging.getLogger("hixl_connector.connector.scheduler.misconfig")
    logger.addHandler(caplog.handler)

    def said(kind: str) -> list[str]:
        # One record (seen once more where the logger also propagates to caplog's root).
        records = {r for r in caplog.records if f"{{kind={kind}}}" in r.getMessage()}
        return [r.getMessage() for r in records]

    def misconfigured(scheduler: Scheduler) -> dict[str, int]:
        stats: Any = scheduler.connector.get_kv_connector_stats()  # type: ignore[union-attr]
        return {} if stats is None else stats.misconfigured()

    try:
        decode = make_scheduler(tiny_model_dir, "kv_consumer")
        for i in range(3):  # straight to D: it computes the whole prompt
            decode.add_request(make_request(f"plain{i}", prompt(20, seed=i)))
        decode.add_request(make_request("d1", prompt(40), params=prefill_params(3)))
        decode.add_request(make_request("local", prompt(20), params={"do_remote_prefill": False}))
        asked = {"do_remote_decode": True, "do_remote_prefill": False}
        decode.add_request(make_request("as-p", prompt(20), params=asked))
        nixl = {k: v for k, v in prefill_params(3).items() if "lease" not in k}
        nixl = {
            k: v for k, v in nixl.items() if k not in ("remote_cluster_id", "remote_incarnation")
        }
        decode.add_request(make_request("nixl", prompt(40), params=nixl))
        assert misconfigured(decode) == {
            "decode_without_params": 3,
            "consumer_asked_to_produce": 1,
            "foreign_params": 1,
        }
        assert misconfigured(decode) == {}  # counted since the last stats
        (without,) = said("decode_without_params")
        assert "request plain0" in without and "must reach D unchanged" in without
        (as_p,) = said("consumer_asked_to_produce")
        assert "request as-p" in as_p and "set kv_role to kv_producer" in as_p
        (foreign,) = said("foreign_params")
        assert "remote_lease_slot" in foreign and "HixlConnector on the prefill side" in foreign

        prefill = make_scheduler(tiny_model_dir, "kv_producer", engine_id="other-p")
        prefill.add_request(make_request("plain", prompt(20)))  # P's everyday request
        prefill.add_request(make_request("as-d", prompt(40), params=prefill_params(3)))
        assert misconfigured(prefill) == {"producer_asked_to_consume": 1}
        (as_d,) = said("producer_asked_to_consume")
        assert "request as-d" in as_d and "set kv_role to kv_consumer" in as_d

        both = make_scheduler(tiny_model_dir, "kv_both", engine_id="other-both")
        both.add_request(make_request("plain", prompt(20)))
        both.add_request(make_request("as-p", prompt(20), params=asked))
        assert misconfigured(both) == {}  # kv_both serves either way
    finally:
        logger.removeHandler(caplog.handler)
