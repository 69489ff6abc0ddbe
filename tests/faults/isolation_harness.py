"""What the isolation tests (test_netns_isolation.py, and push mode's in test_netns_push.py)
share: a bystander stream on D, vllm-router in a namespace of its own, requests through it or
leg by leg, and shutdown under a burst of reads."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from hixl_connector.tools.demo.client import RequestFailed, complete, post_sse
from hixl_connector.tools.demo.servers import RouterProcess, VllmServer, start_router
from hixl_connector.tools.netns import NetnsBed

from .deployments import PULL_TIMEOUT_S
from .fault_harness import (
    SERVED_MODEL_NAME,
    LegResult,
    Servers,
    prefill_leg,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_for,
)

# The bound on a bystander's inter-token gap under any single-peer fault. A step that waited
# on the faulty peer would stall for that fault's timeout (seconds); a healthy step takes a
# few ms, but up to about 0.1 s while a restarting vLLM (its start-up saturates both cores
# of a 2-core host) shares the machine: 0.107 s was seen once in CI.
MAX_GAP_S = 0.25


@contextmanager
def router_in_namespace(
    net: NetnsBed, prefill: VllmServer, decode: VllmServer, log_dir: Path
) -> Iterator[RouterProcess]:
    """vllm-router in the router's namespace of ``net``, sending each request to P, then D
    over the management network (the data link's faults never reach it); healthy, and stopped
    on the way out."""
    router = start_router(
        [prefill.url],
        [decode.url],
        log_dir,
        host=net.router_http,
        wrap=net.exec_prefix(net.ns_router),
    )
    try:
        router.wait_healthy(60.0)
        yield router
    finally:
        router.stop()


def through_router(router: RouterProcess, prompt: list[int]) -> LegResult:
    """A request the way a client sends it: the router runs P's leg, then D's."""
    try:
        out = complete(router.url, prompt, model=SERVED_MODEL_NAME, max_tokens=16, timeout_s=60)
    except RequestFailed as e:
        return LegResult(None, str(e), time.monotonic())
    return LegResult(out.token_ids, None, time.monotonic())


class Bystander:
    """Streams D's own requests (no P involved), one after another, until stopped; keeps the
    largest gap between two tokens of one stream, and when streaming began and ended."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.largest_gap_s = 0.0
        self.tokens = 0
        self._thread = threading.Thread(target=self._run, name="bystander", daemon=True)
        self.error: str | None = None

    def __enter__(self) -> Bystander:
        self._thread.start()
        wait_for(lambda: self.tokens > 20 or self.error is not None, 30.0, "bystander tokens")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60.0)
        assert not self._thread.is_alive(), "the bystander stream did not end"

    def _run(self) -> None:
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": token_prompt(16, seed=999),
            "max_tokens": 200,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            while not self._stop.is_set():
                last = None
                for _ in post_sse(f"{self._url}/v1/completions", body, timeout_s=60.0):
                    now = time.monotonic()
                    if last is not None:
                        self.largest_gap_s = max(self.largest_gap_s, now - last)
                    last = now
                    self.tokens += 1
        except RequestFailed as e:
            self.error = str(e)


def stuck_request(pd: Servers, seed: int, fault: Callable[[], None]) -> tuple[LegResult, float]:
    """P's leg, then ``fault()``, then D's leg while the bystander streams; returns D's leg
    and how long it took."""
    prompt = token_prompt(150, seed)
    params = prefill_leg(pd["prefill"], prompt)
    fault()
    began = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(run_decode, pd["decode"], prompt, params, 60.0).result(120.0)
    return result, result.finished_at - began


def kept_pace(bystander: Bystander) -> None:
    """D kept decoding its own stream: no error, and no gap between two tokens over MAX_GAP_S
    (a step that waited on the faulty peer would have stalled it)."""
    assert bystander.error is None, bystander.error
    assert bystander.largest_gap_s <= MAX_GAP_S, f"D stalled {bystander.largest_gap_s:.3f} s"


def timed_out_in_isolation(bystander: Bystander, result: LegResult, took: float) -> None:
    """D kept decoding its own stream while the stuck read timed out asynchronously."""
    kept_pace(bystander)
    assert result.failed, "a read from a silent P must not succeed"
    assert took <= PULL_TIMEOUT_S + 1.0, f"the stuck request took {took:.2f} s"


def recovered(pd: Servers, seed: int) -> float:
    """Seconds until a request after the fault is token-identical to a plain run."""
    began = time.monotonic()
    two_legs_identical(pd, seed)
    return time.monotonic() - began


SHUTDOWN_BOUND_S = 5.0
BURST = 72  # more than D's 64 reads in flight: some wait for a row on D's pool
SHUT_DOWN = re.compile(r"hixl: worker shut down in ([0-9.]+) s")


def shutdown_took(server: VllmServer) -> float:
    """How long the connector's worker took to shut down, as its log says."""
    found = SHUT_DOWN.findall(server.log_tail(400))
    assert found, f"{server.name} logged no connector shutdown:\n{server.log_tail(40)}"
    return float(found[-1])


def terminate(pd: Servers, name: str) -> float:
    """SIGTERM to the API server alone, as a container runtime sends it (vLLM's API server
    then stops its engine); seconds until every process of the server is gone."""
    began = time.monotonic()
    pid = pd[name].pid
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    pd.wait_gone(name, timeout_s=45.0)
    return time.monotonic() - began


def burst_of_reads(
    pd: Servers, seed: int, fault: Callable[[], None] = lambda: None
) -> tuple[ThreadPoolExecutor, list[Future[LegResult]]]:
    """P's legs for BURST short prompts, ``fault()``, then all their D legs at once (not
    waited for)."""
    prompts = [token_prompt(40, seed + i) for i in range(BURST)]
    legs = [prefill_leg(pd["prefill"], prompt) for prompt in prompts]
    fault()
    pool = ThreadPoolExecutor(BURST)
    futures = [
        pool.submit(run_decode, pd["decode"], prompt, params, 60.0)
        for prompt, params in zip(prompts, legs, strict=True)
    ]
    return pool, futures


def engine_resources(server: VllmServer) -> tuple[int, int]:
    """(open descriptors, threads) of the server's engine process, where the connector's
    worker runs: the API server's child with the most threads."""
    pid = server.pid
    assert pid is not None
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    counts = []
    for child in children:
        try:
            counts.append(
                (len(os.listdir(f"/proc/{child}/task")), len(os.listdir(f"/proc/{child}/fd")))
            )
        except OSError:  # gone meanwhile
            continue
    threads, fds = max(counts)
    return fds, threads


def nothing_left_behind(server: VllmServer, before: tuple[int, int]) -> tuple[int, int]:
    """Waits until the engine's descriptors and threads are back to ``before`` (notice lanes
    idle out after a while); returns what they are."""
    try:
        wait_for(
            lambda: all(n <= b for n, b in zip(engine_resources(server), before, strict=True)),
            15.0,
            f"{server.name}'s descriptors and threads back to {before}",
        )
    except TimeoutError:
        pass
    now = engine_resources(server)
    assert all(n <= b for n, b in zip(now, before, strict=True)), (
        f"{server.name} holds {now[0]} descriptors and {now[1]} threads, {before} before"
    )
    return now
