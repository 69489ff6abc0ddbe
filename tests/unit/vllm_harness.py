"""A real vLLM Scheduler with the HIXL scheduler half, and the worker side played by hand.

Everything is vLLM's own code except the model runner: tests build ModelRunnerOutput and
KVConnectorOutput objects the way the worker would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.facade import HixlConnector
from hixl_connector.connector.link_reports import LinkReport
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.scheduler.decode_side import DecodeSide
from hixl_connector.connector.scheduler.half import HixlScheduler
from hixl_connector.connector.scheduler.prefill_side import PrefillSide
from hixl_connector.tools.vllm_scheduler import BLOCK_SIZE, model_runner_output, real_scheduler

P_INCARNATION = 0xC0FFEE  # the start nonce of the P that prefill_params come from
# The P that prefill_params name, as D's scheduler resolves it from them.
PREFILL = RemoteEndpoint("prefill-engine", "10.0.0.9", 7100, 1, 8192, P_INCARNATION)
EXTRA_CONFIG = {"side_channel_host": "10.0.0.7", "side_channel_port": 6100, "cluster_id_base": 4096}

# vLLM 0.32 schedules asynchronously by default (AsyncScheduler); the tests that drive the
# real scheduler run both ways (the ``scheduling`` fixture sets this).
ASYNC_SCHEDULING = False

init_none_hash(sha256)
_block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)


PUSH_MODE = {"transfer_mode": "push"}  # kv_connector_extra_config of a push-mode server
# What vllm-router 0.1.17 sends D once P answered with its push identity (seen on the wire:
# the X-Request-Id comes along as remote_request_id).
PUSH_IDENTITY = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine",
    "remote_host": "10.0.0.9",
    "remote_port": 7100,
    "tp_size": 1,
    "remote_request_id": "x-request-id",
}


def make_scheduler(
    model_dir: Path,
    kv_role: str,
    *,
    policy: str = "fail",
    num_blocks: int = 64,
    engine_id: str = "engine-under-test",
    extra: dict[str, Any] | None = None,
    sliding_window: int = 0,
    max_num_batched_tokens: int | None = None,
    state: str = "",
) -> Scheduler:
    """vLLM's scheduler with the connector (tools.vllm_scheduler), scheduling as
    ASYNC_SCHEDULING says."""
    return real_scheduler(
        model_dir,
        kv_role,
        engine_id=engine_id,
        num_blocks=num_blocks,
        policy=policy,
        extra={**EXTRA_CONFIG, **(extra or {})},
        async_scheduling=ASYNC_SCHEDULING,
        sliding_window=sliding_window,
        state=state,
        **({"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}),
    )


def hixl(scheduler: Scheduler) -> HixlScheduler:
    """The scheduler half inside the real HixlConnector that vLLM built."""
    connector: Any = scheduler.connector
    assert isinstance(connector, HixlConnector) and connector._scheduler is not None
    return connector._scheduler


def decode_side(scheduler: Scheduler) -> DecodeSide:
    side = hixl(scheduler).decode
    assert side is not None, "not a kv_consumer"
    return side


def prefill_side(scheduler: Scheduler) -> PrefillSide:
    side = hixl(scheduler).prefill
    assert side is not None, "not a kv_producer"
    return side


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    (group,) = scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(group)


def group_block_ids(scheduler: Scheduler, request_id: str) -> list[list[int]]:
    """The request's blocks in each KV-cache group (vLLM's null block where a group holds
    none)."""
    return [list(group) for group in scheduler.kv_cache_manager.get_block_ids(request_id)]


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int = 4,
    params: dict[str, Any] | None = None,
    **sampling: Any,
) -> Request:
    extra_args = {"kv_transfer_params": params} if params is not None else None
    sampling_params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args, **sampling
    )
    return Request(request_id, list(prompt), sampling_params, None, block_hasher=_block_hasher)


def prefill_params(num_blocks: int, *, first_block: int = 100, **overrides: Any) -> dict:
    """kv_transfer_params as P returns them (see build_remote_decode_params)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(first_block, first_block + num_blocks))],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "p-req",
        "remote_host": "10.0.0.9",
        "remote_port": 7100,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_blocks * BLOCK_SIZE,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_cluster_id": 8192,
        "remote_lease_id": 77,
        "remote_lease_slot": 5,
        "remote_incarnation": P_INCARNATION,
    }
    params.update(overrides)
    return params


def metadata(output: SchedulerOutput) -> HixlConnectorMetadata:
    meta = output.kv_connector_metadata
    assert isinstance(meta, HixlConnectorMetadata)
    return meta


def runner_output(
    output: SchedulerOutput,
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    link_report: LinkReport | None = None,
    token_id: int = 5,
    partial: set[str] | None = None,
) -> ModelRunnerOutput:
    """What the worker returns for ``output``: one sampled token per scheduled request, none
    for those in ``partial`` (a chunk short of the prompt's end: vLLM's runner discards it)."""
    req_ids = list(output.num_scheduled_tokens)
    kv_output = KVConnectorOutput(
        finished_sending=finished_sending or set(),
        finished_recving=(finished_recving or set()) | (failed_recving or set()),
        failed_recving=failed_recving or set(),
        invalid_block_ids=invalid_block_ids or set(),
        kv_connector_worker_meta=link_report,  # type: ignore[arg-type]  # registered ABC
    )
    return model_runner_output(
        req_ids,
        sampled_token_ids=[[] if r in (partial or ()) else [token_id] for r in req_ids],
        kv_connector_output=kv_output,
    )


def step(scheduler: Scheduler, **worker: Any) -> tuple[SchedulerOutput, dict[int, Any]]:
    """One engine step: schedule, then feed back the worker's (hand-made) output."""
    output = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(output, runner_output(output, **worker))
    return output, engine_outputs


def served_locally(scheduler: Scheduler, request_id: str, prompt_ids: list[int]) -> list[int]:
    """Serves a one-token request on this engine itself, so its prompt's full blocks enter
    the local prefix cache; returns the block ids it had."""
    scheduler.add_request(make_request(request_id, prompt_ids, max_tokens=1))
    output = scheduler.schedule()
    blocks = group_block_ids(scheduler, request_id)[0]
    scheduler.update_from_output(output, runner_output(output))
    return blocks


def finished_outputs(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    return {
        out.request_id: out
        for client in engine_outputs.values()
        for out in client.outputs
        if out.finish_reason is not None
    }


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 300 + 3 for i in range(num_tokens)]


def run_until_finished(scheduler: Scheduler, request_id: str, max_steps: int = 20) -> Any:
    for _ in range(max_steps):
        _, engine_outputs = step(scheduler)
        finished = finished_outputs(engine_outputs)
        if request_id in finished:
            return finished[request_id]
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")
