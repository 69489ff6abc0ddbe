"""P's scheduler half inside vLLM's real Scheduler (CPU, one process, no worker): how a
prefill engine leases, publishes and frees what it computed, and what it counts.

The worker side is played by hand: each step the test returns a ModelRunnerOutput with the
KVConnectorOutput a worker would report (finished_recving, failed_recving, finished_sending).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm_harness import (
    EXTRA_CONFIG,
    block_ids,
    finished_outputs,
    free_blocks,
    hixl,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prefill_side,
    prompt,
    runner_output,
    step,
)

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import rank_address
from hixl_connector.connector.leases.guarded_read import lease_word
from hixl_connector.connector.metadata import HixlConnectorMetadata, SendSpec
from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS

pytestmark = pytest.mark.usefixtures("scheduling")


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


class Words:
    """P's workers as the connector's metadata drives them: each step's clears, then its
    publications, applied before the step's forward (the worker's bind)."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}

    def bind(self, output: SchedulerOutput) -> HixlConnectorMetadata:
        meta = metadata(output)
        for clear in meta.to_clear:
            if self.words.get(clear.slot) == clear.word:
                del self.words[clear.slot]
        for word in meta.to_publish:
            self.words[word.slot] = word.word
        return meta


def expected_word(params: dict[str, Any]) -> int:
    """The word D computes from P's params (decode_side)."""
    return lease_word(
        params["remote_lease_id"], params["remote_block_ids"], params["remote_incarnation"]
    )


def test_a_lease_is_published_in_the_step_that_computes_the_prompt_and_its_slot_reused_after(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", engine_id="prefill-w")
    workers = Words()
    slots = []
    for request_id in ("p1", "p2"):
        params = dict(PREFILL_LEG_PARAMS)
        scheduler.add_request(make_request(request_id, prompt(40, 1), max_tokens=1, params=params))
        output = scheduler.schedule()
        workers.bind(output)  # before the forward of the step whose output finishes it
        engine_outputs = scheduler.update_from_output(output, runner_output(output))
        sent = finished_outputs(engine_outputs)[request_id].kv_transfer_params
        slot = sent["remote_lease_slot"]
        assert workers.words[slot] == expected_word(sent)  # D can check it at once
        # The worker clears it before it reports the lease ended; then the slot is free.
        del workers.words[slot]
        workers.bind(step(scheduler, finished_sending={request_id})[0])
        slots.append(slot)
    assert slots[0] == slots[1]  # freed once reported, and taken again
    assert workers.words == {}


def test_a_chunked_prompt_is_published_in_the_step_of_its_last_chunk(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer", max_num_batched_tokens=32)
    workers = Words()
    scheduler.add_request(
        make_request("c1", prompt(80, 2), max_tokens=1, params={**PREFILL_LEG_PARAMS})
    )
    published = []
    sent: dict[str, Any] = {}
    for chunk in range(3):  # 32 + 32 + 16 prompt tokens
        output = scheduler.schedule()
        published.append(len(workers.bind(output).to_publish))
        worker = runner_output(output, partial={"c1"} if chunk < 2 else set())
        finished = finished_outputs(scheduler.update_from_output(output, worker))
        if "c1" in finished:
            sent = finished["c1"].kv_transfer_params
    assert published == [0, 0, 1]  # once the blocks of the whole prompt are allocated
    assert [len(group) for group in sent["remote_block_ids"]] == [5]
    assert workers.words[sent["remote_lease_slot"]] == expected_word(sent)


def test_a_word_of_a_prompt_that_never_leases_is_cleared_before_its_blocks_are_reused(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_producer")
    workers = Words()
    idle = free_blocks(scheduler)
    scheduler.add_request(
        make_request("a1", prompt(40), max_tokens=1, params={**PREFILL_LEG_PARAMS})
    )
    output = scheduler.schedule()
    assert len(workers.bind(output).to_publish) == 1  # published before the forward
    # Aborted while its step ran: vLLM frees its blocks at once, and hands out no params.
    scheduler.finish_requests("a1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(scheduler) == idle
    assert finished_outputs(scheduler.update_from_output(output, runner_output(output))) == {}
    # The next step may give those blocks to another prompt: its bind clears the word
    # before its forward writes them.
    scheduler.add_request(
        make_request("a2", prompt(40, 3), max_tokens=1, params={**PREFILL_LEG_PARAMS})
    )
    meta = workers.bind(scheduler.schedule())
    assert len(meta.to_clear) == 1 and len(meta.to_publish) == 1
    assert list(workers.words) == [meta.to_publish[0].slot]  # a1's word is gone
    assert len(prefill_side(scheduler).published) == 1


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
