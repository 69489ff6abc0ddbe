"""Reads in the step that computes the first token (vLLM's synchronous load): which requests
get them, inside vLLM's real Scheduler, and the pure bookkeeping behind the choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm_harness import (
    BLOCK_SIZE,
    PREFILL,
    block_ids,
    decode_side,
    finished_outputs,
    make_request,
    make_scheduler,
    metadata,
    prefill_params,
    prompt,
    runner_output,
    served_locally,
    step,
)

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.link_reports import MAX_REPORTED_ENGINES, LinkReport, LinkReporter
from hixl_connector.connector.metadata import RecvSpec
from hixl_connector.connector.scheduler.sync_loads import SyncLoads

pytestmark = pytest.mark.usefixtures("scheduling")

# The harness's blocks: 16 tokens x 2 KV heads x 16 x fp32, K and V, two layers.
BLOCK_BYTES = 2 * BLOCK_SIZE * 2 * 16 * 4 * 2
SMALL_BLOCKS = 3  # sync_load_bytes below: reads of up to 3 blocks go in the step
EXTRA = {"sync_load_bytes": SMALL_BLOCKS * BLOCK_BYTES}


def admit(
    scheduler: Scheduler, request_id: str, num_blocks: int, seed: int
) -> tuple[RecvSpec, SchedulerOutput]:
    """Adds a remote-prefill request of ``num_blocks`` blocks and schedules a step: its read,
    and the step."""
    request = make_request(
        request_id,
        prompt(num_blocks * BLOCK_SIZE - 4, seed),
        params=prefill_params(num_blocks, remote_request_id=f"p-{request_id}"),
    )
    scheduler.add_request(request)
    output = scheduler.schedule()
    (spec,) = metadata(output).to_recv
    return spec, output


def finish_step(scheduler: Scheduler, output: SchedulerOutput, **worker: object) -> dict[str, int]:
    """Feeds back the worker's output for the step ``admit`` scheduled."""
    scheduler.update_from_output(output, runner_output(output, **worker))
    return dict(output.num_scheduled_tokens)


def in_place(remote: RemoteEndpoint = PREFILL, ok: bool = True, rank: int = 0) -> LinkReport:
    """A worker's report: rank ``rank`` reads ``remote`` in place (or no longer does)."""
    return LinkReport({rank: {remote: ok}})


def warm(scheduler: Scheduler) -> None:
    """A first, asynchronous read from PREFILL succeeds over a same-host link."""
    spec, output = admit(scheduler, "first", 2, seed=9)
    assert not spec.synchronous
    finish_step(scheduler, output)
    step(scheduler, finished_recving={"first"}, link_report=in_place())
    assert decode_side(scheduler).loads.in_place_engines() == 1


def test_the_first_read_from_an_engine_is_asynchronous_then_small_ones_go_in_the_step(
    tiny_model_dir: Path,
) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", extra=EXTRA)
    first, output = admit(scheduler, "first", 2, seed=1)
    assert not first.synchronous
    assert scheduler.requests["first"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert finish_step(scheduler, output) == {}
    step(scheduler, finished_recving={"first"}, link_report=in_place())

    spec, output = admit(scheduler, "small", SMALL_BLOCKS, seed=2)
    assert spec.synchronous
    assert spec.local_block_ids == tuple(block_ids(scheduler, "small"))
    assert len(spec.local_block_ids) == SMALL_BLOCKS
    request = scheduler.requests["small"]
    assert request.status == RequestStatus.RUNNING
    # Its KV is in place before this step's forward: no lease to renew, nothing told (only
    # that the first request's wait ended).
    assert metadata(output).waiting == [] and metadata(output).done_waiting == ["first"]
    # Computed in this very step: the last prompt token, for the first output token.
    assert finish_step(scheduler, output)["small"] == 1
    assert request.num_output_tokens == 1
    assert "small" not in decode_side(scheduler).receiving

    large, _ = admit(scheduler, "large", SMALL_BLOCKS + 1, seed=3)
    assert not large.synchronous
    assert scheduler.requests["large"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_reads_over_the_network_never_go_in_the_step(tiny_model_dir: Path) -> None:
    """A worker whose read from P crossed the network reports it not in place: small reads
    stay asynchronous, so that no step of D waits on a peer."""
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", extra=EXTRA)
    first, output = admit(scheduler, "first", 2, seed=1)
    finish_step(scheduler, output)
    step(scheduler, finished_recving={"first"}, link_report=in_place(ok=False))
    assert decode_side(scheduler).loads.in_place_engines() == 0
    assert not admit(scheduler, "small", 1, seed=2)[0].synchronous


def test_a_synchronous_load_failure_recomputes(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy="recompute", extra=EXTRA)
    warm(scheduler)
    spec, output = admit(scheduler, "bad", 2, seed=4)
    assert spec.synchronous
    request = scheduler.requests["bad"]
    finish_step(scheduler, output, invalid_block_ids={spec.local_block_ids[0]})
    # vLLM dropped the token sampled on missing KV and recomputes the prompt itself.
    assert request.num_output_tokens == 0
    assert request.num_computed_tokens == 0
    output, _ = step(scheduler)
    # The whole prompt (an asynchronous scheduler also schedules the placeholder of the
    # token it expected from the failed step).
    assert output.num_scheduled_tokens["bad"] >= request.num_prompt_tokens


def test_a_lost_link_turns_its_engine_asynchronous(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", policy="recompute", extra=EXTRA)
    warm(scheduler)
    other = RemoteEndpoint("other-engine", "10.0.0.9", 7200, 1, 16384)
    step(scheduler, link_report=in_place(other))
    step(scheduler, link_report=in_place(ok=False))
    assert decode_side(scheduler).loads.in_place_engines() == 1  # the other engine's link stands
    assert not admit(scheduler, "after", 2, seed=8)[0].synchronous


def test_off_with_zero_bytes(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(tiny_model_dir, "kv_consumer", extra={"sync_load_bytes": 0})
    warm(scheduler)
    spec, output = admit(scheduler, "small", 1, seed=10)
    assert not spec.synchronous
    finish_step(scheduler, output)
    for _ in range(3):
        step(scheduler)
    step(scheduler, finished_recving={"small"})
    _, outputs = step(scheduler)
    assert "small" not in finished_outputs(outputs)  # decoding after its async load


@given(
    reports=st.lists(st.tuples(st.integers(0, 2), st.booleans()), max_size=8),
    num_computed=st.integers(0, 8).map(lambda b: b * 16),
    extra_tokens=st.integers(0, 200),
    limit_blocks=st.integers(0, 10),
)
def test_wanted_exactly_for_small_reads_every_rank_reads_in_place(
    reports: list[tuple[int, bool]], num_computed: int, extra_tokens: int, limit_blocks: int
) -> None:
    loads = SyncLoads(limit_blocks * 100, block_bytes=100, block_size=16, ranks=3)
    ranks: set[int] = set()
    for rank, ok in reports:  # one rank's report per step, in order: the last one holds
        loads.report(in_place(ok=ok, rank=rank))
        (ranks.add if ok else ranks.discard)(rank)
    num_tokens = num_computed + extra_tokens
    blocks = -(-num_tokens // 16) - num_computed // 16
    expected = len(ranks) == 3 and extra_tokens >= 2 and blocks <= limit_blocks
    assert loads.wanted(PREFILL, num_computed, num_tokens) == expected


def test_aggregated_reports_of_every_rank_make_an_engine_in_place() -> None:
    """vLLM aggregates the TP ranks' reports of a step into one (LinkReport.aggregate)."""
    loads = SyncLoads(1 << 20, block_bytes=1, block_size=16, ranks=2)
    loads.report(in_place(rank=0))
    assert not loads.wanted(PREFILL, 0, 32)
    loads.report(in_place(rank=1).aggregate(in_place(PREFILL, ok=False, rank=0)))
    assert not loads.wanted(PREFILL, 0, 32)
    loads.report(in_place(rank=0).aggregate(LinkReport()))
    assert loads.wanted(PREFILL, 0, 32)


def test_reporter_sends_changes_only() -> None:
    reporter = LinkReporter(rank=1)
    assert reporter.take() is None
    reporter.read(PREFILL, True)
    reporter.read(PREFILL, True)
    assert reporter.take() == in_place(rank=1)
    reporter.read(PREFILL, True)
    assert reporter.take() is None  # nothing changed
    reporter.lost(PREFILL)
    reporter.read(PREFILL, True)  # in one step: the last word holds, and it is no change
    assert reporter.take() == LinkReport({1: {PREFILL: True}})


def test_unknown_block_bytes_never_read_in_the_step() -> None:
    loads = SyncLoads(1 << 20, block_bytes=0, block_size=16, ranks=1)
    loads.report(in_place())
    assert not loads.wanted(PREFILL, 0, 32)


def test_in_place_engines_are_bounded() -> None:
    loads = SyncLoads(1 << 20, block_bytes=1, block_size=16, ranks=1)
    for i in range(MAX_REPORTED_ENGINES + 10):
        loads.report(in_place(RemoteEndpoint(f"p{i}", "10.0.0.1", 7000, 1, 0)))
    assert loads.in_place_engines() == MAX_REPORTED_ENGINES
    assert not loads.wanted(RemoteEndpoint("p0", "10.0.0.1", 7000, 1, 0), 0, 32)  # oldest


def test_a_synchronous_read_after_a_prefix_hit_reads_only_the_suffix(tiny_model_dir: Path) -> None:
    scheduler = make_scheduler(
        tiny_model_dir, "kv_consumer", extra={"sync_load_bytes": 8 * BLOCK_BYTES}
    )
    warm(scheduler)
    shared = prompt(2 * BLOCK_SIZE, seed=11)
    local_blocks = served_locally(scheduler, "local", shared + prompt(8, seed=12))

    request = make_request("d", shared + prompt(24, seed=13), params=prefill_params(4))
    scheduler.add_request(request)
    output = scheduler.schedule()
    (spec,) = metadata(output).to_recv
    assert spec.synchronous
    blocks = block_ids(scheduler, "d")
    assert blocks[:2] == local_blocks[:2]  # the local prefix-cache hit
    assert spec.local_block_ids == tuple(blocks[2:])
    assert spec.remote_block_ids == (102, 103)  # the suffix of P's 100..103
    assert output.num_scheduled_tokens["d"] == 1
