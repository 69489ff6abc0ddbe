"""``python -m hixl_connector bench-step``: the connector's own time per engine step while many
requests wait for remote KV, measured inside vLLM's real scheduler (D's scheduler half:
``build_connector_meta`` and ``update_connector_output``) and on a worker (its lease client's
step: the waiting changes and the heartbeats due), next to the same steps with one request
waiting. P never answers, so every request stays waiting for the whole run; heartbeats fall
due every ``heartbeat_s`` as in service.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hixl_connector.tools.vllm_scheduler import model_runner_output, real_scheduler

STEPS = 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-step")
    parser.add_argument("--waiting", type=int, default=2000, help="requests waiting for KV")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps measured")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        from hixl_connector.tools.demo.tiny_model import build_tiny_model

        model = build_tiny_model(Path(tmp) / "model")
        rows = [
            ("scheduler half", scheduler_step_us(model, 1, args.steps)),
            ("scheduler half", scheduler_step_us(model, args.waiting, args.steps)),
            ("worker lease client", worker_step_us(1, args.steps)),
            ("worker lease client", worker_step_us(args.waiting, args.steps)),
        ]
    print("| side | requests waiting | median µs/step | p99 µs/step | vs 1 waiting |")
    print("|---|---|---|---|---|")
    for index, (side, (waiting, median, p99)) in enumerate(rows):
        base = rows[index - index % 2][1][1]
        print(f"| {side} | {waiting} | {median:.1f} | {p99:.1f} | {median / base:.2f}x |")
    return 0


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[int(0.99 * (len(ordered) - 1))] * 1e6


def scheduler_step_us(model: Path, waiting: int, steps: int) -> tuple[int, float, float]:
    """(waiting, median, p99) of the connector's hooks per step in vLLM's scheduler."""
    scheduler, hixl = _decode_scheduler(model, num_blocks=2 * waiting + 64)
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    for i in range(waiting):
        params = _params(i)
        sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
        scheduler.add_request(Request(f"r{i}", list(range(1, 30)), sampling, None))
    spent: list[float] = []
    for name in ("build_connector_meta", "update_connector_output"):
        _time_calls(hixl, name, spent)
    for _ in range(100):  # until every request waits for its KV (allocated, read asked for)
        output = scheduler.schedule()
        scheduler.update_from_output(output, _empty_runner_output(output))
        statuses = [request.status for request in scheduler.requests.values()]
        if statuses.count(RequestStatus.WAITING_FOR_REMOTE_KVS) == waiting:
            break
    else:
        raise RuntimeError(
            f"{statuses.count(RequestStatus.WAITING_FOR_REMOTE_KVS)} of "
            f"{waiting} requests reached WAITING_FOR_REMOTE_KVS"
        )
    del spent[:]
    for _ in range(steps):
        output = scheduler.schedule()
        scheduler.update_from_output(output, _empty_runner_output(output))
    per_step = [sum(spent[i : i + 2]) for i in range(0, len(spent) - 1, 2)]
    return (waiting, *_percentiles(per_step))


def worker_step_us(waiting: int, steps: int) -> tuple[int, float, float]:
    """(waiting, median, p99) of a worker's lease-client step (changes, heartbeats due)."""
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.leases.client import LeaseClient
    from hixl_connector.connector.metadata import WaitingRead

    client = LeaseClient(
        client_for=_never_sent,
        is_linked=lambda target: True,
        targets=lambda remote: {0: 1},
        heartbeat_s=0.05,
        rank=0,
        record=lambda counter: None,
    )
    client._post = lambda outgoing: None  # type: ignore[method-assign]  # measure, send nothing
    remote = RemoteEndpoint("p", "10.0.0.9", 7100, 1, 8192, 1)
    reads = [WaitingRead(f"r{i}", remote, f"p{i}", i) for i in range(waiting)]
    now = time.monotonic()
    client.waiting(reads, [], now)
    spent = []
    for step in range(steps):
        began = time.perf_counter()
        client.waiting([], [], now + 0.01 * step)  # a heartbeat falls due every 5 steps
        spent.append(time.perf_counter() - began)
        for due in list(client._heartbeats._in_flight):
            client._heartbeats.finished(due)
    client.shutdown()
    return (waiting, *_percentiles(spent))


def _never_sent(target: Any) -> Any:
    raise AssertionError("the benchmark sends nothing")


def _time_calls(obj: Any, name: str, spent: list[float]) -> None:
    method: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    setattr(obj, name, timed)


def _params(i: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[100 + i, 101 + i]],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": f"p{i}",
        "remote_host": "10.0.0.9",
        "remote_port": 7100,
        "tp_size": 1,
        "remote_num_tokens": 29,
        "remote_cluster_id": 8192,
        "remote_lease_id": i,
        "remote_lease_slot": i % 1024,
        "remote_incarnation": 1,
    }


def _decode_scheduler(model: Path, num_blocks: int) -> tuple[Any, Any]:
    scheduler = real_scheduler(
        model,
        "kv_consumer",
        engine_id="bench-step",
        num_blocks=num_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    connector: Any = scheduler.connector
    return scheduler, connector._scheduler


def _empty_runner_output(output: Any) -> Any:
    req_ids = list(output.num_scheduled_tokens)
    return model_runner_output(
        req_ids,
        sampled_token_ids=[[5] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
