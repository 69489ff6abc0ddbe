"""Push mode's faults: P and D each in their own network namespace, TCP, P writing into
blocks D granted it. The legs are sent as vllm-router sends them once P answered with its
push identity (both at once, one X-Request-Id, D naming P by address only), or through the
router itself.

Each case asserts how and when the stuck request ended, that D kept decoding its own stream
meanwhile, that a write P made after D gave up was refused by D's engine rather than landing
in blocks D had taken back, that the next request is token-identical to a plain run, and that
nothing is left leased or held.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS, RequestFailed, complete
from hixl_connector.tools.demo.servers import RouterProcess, start_router
from hixl_connector.tools.netns import NetnsBed

from .deployments import HANDSHAKE_TIMEOUT_S, HEARTBEAT_S, LEASE_S, PULL_TIMEOUT_S
from .deployments import connector_config as base_config
from .fault_harness import (
    SERVED_MODEL_NAME,
    FaultReport,
    LegResult,
    Servers,
    both_idle,
    hixl_counter,
    in_namespaces,
    plain,
    token_prompt,
    wait_for,
    wait_idle,
)
from .isolation_harness import MAX_GAP_S, Bystander, through_router

IDLE_TIMEOUT_S = LEASE_S + 10.0
MAX_TOKENS = 16
# P's side of the data link while a fault lands mid-push: a 160-token prompt's blocks (5 of
# 32 KiB) take about 2 s to write, under PULL_TIMEOUT_S, so an unfaulted push would land.
MID_PUSH_RATE = "640kbit"
INTO_THE_PUSH_S = 0.5
# D's client gives up this long after it sent D's leg: after P's prefill, within the push.
ABORT_AFTER_S = 1.0
# D's failed receive after P died: D's own timeout, then the revoke waits out what P's slowed
# link still delivers of the write under way.
MARGIN_S = 3.0


def connector_config(role: str) -> dict[str, Any]:
    return base_config(
        role,
        transfer_mode="push",
        transport="tcp",
        lease_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
        pull_timeout_s=PULL_TIMEOUT_S,
        handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
    )


def leg(
    url: str, prompt: list[int], params: dict[str, Any], request_id: str, timeout_s: float
) -> tuple[LegResult, dict[str, Any] | None]:
    """One leg, with the request id both legs share; and P's answer."""
    try:
        out = complete(
            url,
            prompt,
            model=SERVED_MODEL_NAME,
            max_tokens=1 if params.get("do_remote_decode") else MAX_TOKENS,
            extra={"kv_transfer_params": params},
            headers={"X-Request-Id": request_id},
            timeout_s=timeout_s,
        )
    except RequestFailed as e:
        return LegResult(None, str(e), time.monotonic()), None
    if out.finish_reason == "error":
        return LegResult(out.token_ids, "finish_reason=error", time.monotonic()), None
    return LegResult(out.token_ids, None, time.monotonic()), out.kv_transfer_params


def identity(answer: dict[str, Any]) -> dict[str, Any]:
    """What the router sends D once P answered with ``answer`` (its push identity)."""
    assert answer["transfer_mode"] == "push", answer
    keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
    return {"do_remote_prefill": True, "do_remote_decode": False, **{k: answer[k] for k in keys}}


class PushPair:
    """P and D in push mode, and the identity of P that D is sent (the router's cache)."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.identity: dict[str, Any] = {}
        self.pool = ThreadPoolExecutor(4)

    def __getitem__(self, name: str) -> Any:
        return self.servers[name]

    def p_leg(self, prompt: list[int], request_id: str, timeout_s: float = 60.0) -> Future:
        return self.pool.submit(
            leg, self["prefill"].url, prompt, dict(PREFILL_LEG_PARAMS), request_id, timeout_s
        )

    def d_leg(self, prompt: list[int], request_id: str, timeout_s: float = 60.0) -> Future:
        return self.pool.submit(
            leg, self["decode"].url, prompt, dict(self.identity), request_id, timeout_s
        )

    def learn_identity(self, seed: int) -> None:
        """A sequential request, as the router's first: P's answer is its identity."""
        prompt = token_prompt(100, seed)
        request_id = uuid.uuid4().hex
        result, answer = self.p_leg(prompt, request_id).result(120)
        assert result.error is None and answer, result.error
        self.identity = identity(answer)
        decoded, _ = self.d_leg(prompt, request_id).result(120)
        assert decoded.tokens == plain(self["prefill"], prompt, MAX_TOKENS), decoded.error

    def concurrent_identical(self, seed: int) -> None:
        """Both legs at once: D's tokens are the plain run's, and P pushed them."""
        prompt = token_prompt(150, seed)
        expected = plain(self["prefill"], prompt, MAX_TOKENS)
        request_id = uuid.uuid4().hex
        d_leg = self.d_leg(prompt, request_id)
        p_result, _ = self.p_leg(prompt, request_id).result(120)
        d_result, _ = d_leg.result(120)
        assert p_result.error is None and d_result.error is None, (p_result, d_result)
        assert d_result.tokens == expected

    def registered(self, before: float) -> None:
        """Until P accepted D's registration (D counts it; an idle P reports nothing)."""
        wait_for(
            lambda: hixl_counter(self["decode"], "push_registrations") > before,
            10.0,
            "D's registration at P",
        )


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[PushPair]:
    configs = {role: connector_config(role) for role in ("prefill", "decode")}
    configs["prefill"]["kv_connector_extra_config"]["engine_port"] = 0
    servers = in_namespaces(model_dir, log_dir / "netns_push", configs, net)
    pair = PushPair(servers)
    try:
        servers.start("prefill", "decode")
        pair.learn_identity(seed=0)
        pair.concurrent_identical(seed=1)  # linked both ways, pushes proven
        yield pair
    finally:
        pair.pool.shutdown(wait=False, cancel_futures=True)
        servers.stop_all()


@pytest.fixture(scope="module")
def router(pd: PushPair, log_dir: Path, net: NetnsBed) -> Iterator[RouterProcess]:
    router = start_router(
        [pd["prefill"].url],
        [pd["decode"].url],
        log_dir / "netns_push",
        host=net.router_http,
        wrap=net.exec_prefix(net.ns_router),
    )
    try:
        router.wait_healthy(60.0)
        yield router
    finally:
        router.stop()


def _stuck(pd: PushPair, seed: int, d_timeout_s: float) -> tuple[LegResult, float]:
    """D registers; P is stopped before it prefills; D's leg ends (D's own timeout, or the
    client's ``d_timeout_s``) and D takes its blocks back (D revokes before it reports a
    failure, and before vLLM frees an aborted request's blocks); only then does P resume and
    prefill. Returns D's leg and how long it took."""
    prompt = token_prompt(150, seed)
    request_id = uuid.uuid4().hex
    registered = hixl_counter(pd["decode"], "push_registrations")
    began = time.monotonic()
    d_leg = pd.d_leg(prompt, request_id, timeout_s=d_timeout_s)
    pd.registered(registered)
    pd.servers.kill("prefill", signal.SIGSTOP)
    try:
        p_leg = pd.p_leg(prompt, request_id)
        d_result, _ = d_leg.result(120)
        took = time.monotonic() - began
        if d_timeout_s < PULL_TIMEOUT_S:  # the client gave up: D aborts after that
            wait_idle(pd["decode"], 10.0)  # revoked and reported: vLLM freed D's blocks
    finally:
        pd.servers.kill("prefill", signal.SIGCONT)
    p_result, _ = p_leg.result(120)
    assert p_result.error is None, p_result.error
    return d_result, took


def test_prefill_stopped_before_its_push_d_gives_up_on_its_own(
    pd: PushPair, fault_report: FaultReport
) -> None:
    timeouts = hixl_counter(pd["decode"], "push_timeouts")
    pushes = hixl_counter(pd["prefill"], "pushes")
    with Bystander(pd["decode"].url) as bystander:
        result, took = _stuck(pd, seed=10, d_timeout_s=60.0)
    assert bystander.error is None, bystander.error
    assert bystander.largest_gap_s <= MAX_GAP_S, f"D stalled {bystander.largest_gap_s:.3f} s"
    assert result.failed, "a request P never pushed must not decode"
    assert took <= PULL_TIMEOUT_S + 1.5, f"the stuck request took {took:.2f} s"
    assert hixl_counter(pd["decode"], "push_timeouts") == timeouts + 1
    pd.concurrent_identical(seed=11)
    # The stuck request's push never landed: D had given up (P forgot the registration, or
    # D's engine refused the write under the revoked grant).
    assert hixl_counter(pd["prefill"], "pushes") == pushes + 1
    fault_report.record(
        "push, netns + TCP: P stopped (SIGSTOP) after D registered, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; D gives up "
        "after pull_timeout_s on its own, revokes its grants and fails the request; P, "
        "resumed, writes nothing into blocks D took back; next request identical",
        took,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )


def test_decode_aborted_while_waiting_for_the_push_refuses_the_late_write(
    pd: PushPair, fault_report: FaultReport
) -> None:
    """The client gives up on D's leg: vLLM aborts it, D revokes and frees at once. P,
    resumed within D's wait, still holds the registration and pushes: D's engine refuses
    every byte (the write names a revoked grant)."""
    refused = hixl_counter(pd["prefill"], "failed_pushes")
    result, took = _stuck(pd, seed=20, d_timeout_s=1.0)
    assert result.failed, "an aborted request must not decode"
    wait_for(
        lambda: hixl_counter(pd["prefill"], "failed_pushes") >= refused + 1,
        10.0,
        "P's refused push",
    )
    assert "is not under grant" in pd["prefill"].log_tail(300)
    pd.concurrent_identical(seed=21)
    fault_report.record(
        "push, netns + TCP: D's client disconnects while D waits for P's push",
        "vLLM aborts the request; D revokes its grants and frees its blocks; P's push, "
        "later, is refused by D's engine (it names a revoked grant); next request identical",
        took,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )


def _mid_push(
    pd: PushPair, net: NetnsBed, seed: int, d_timeout_s: float = 60.0
) -> tuple[Future, float]:
    """D registered and P's prefill done, its writes crawling over the slowed link,
    INTO_THE_PUSH_S in; D's leg (its client gives up after ``d_timeout_s``) and how many
    pushes P had finished before this one."""
    prompt = token_prompt(160, seed)
    request_id = uuid.uuid4().hex
    registered = hixl_counter(pd["decode"], "push_registrations")
    d_leg = pd.d_leg(prompt, request_id, timeout_s=d_timeout_s)
    pd.registered(registered)
    pushes = hixl_counter(pd["prefill"], "pushes")
    net.throttle(MID_PUSH_RATE)
    p_result, _ = pd.p_leg(prompt, request_id).result(60)
    assert p_result.error is None, p_result.error
    time.sleep(INTO_THE_PUSH_S)
    return d_leg, pushes


def test_prefill_killed_mid_push_d_fails_on_its_own(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """P dies with D's blocks half written: no word ever comes, D gives up within
    pull_timeout_s, revokes (after the write under way ended with P's connection) and fails
    the request; D keeps streaming its own; a restarted P serves the next request."""
    timeouts = hixl_counter(pd["decode"], "push_timeouts")
    with Bystander(pd["decode"].url) as bystander:
        try:
            d_leg, pushes = _mid_push(pd, net, seed=40)
            assert hixl_counter(pd["prefill"], "pushes") == pushes, "the push ended before P died"
            pd.servers.kill("prefill")
            killed_at = time.monotonic()
            result, _ = d_leg.result(60)
            detected = result.finished_at - killed_at
        finally:
            net.restore()
    assert bystander.error is None, bystander.error
    assert bystander.largest_gap_s <= MAX_GAP_S, f"D stalled {bystander.largest_gap_s:.3f} s"
    assert result.failed, "a request whose push P never finished must not decode"
    assert detected <= PULL_TIMEOUT_S + MARGIN_S, f"D failed it {detected:.2f} s after P died"
    assert hixl_counter(pd["decode"], "push_timeouts") == timeouts + 1
    pd.servers.wait_gone("prefill")
    restarted = pd.servers.restart("prefill", engine_id=f"push-p-{uuid.uuid4().hex[:8]}")
    pd.learn_identity(seed=41)
    pd.concurrent_identical(seed=42)
    fault_report.record(
        "push, netns + TCP: P killed (SIGKILL) mid-push, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; no word comes, "
        "D gives up after pull_timeout_s on its own, revokes its grants and fails the "
        f"request; P restarted in {restarted:.0f} s, next request identical",
        detected,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )


def test_decode_aborted_mid_push_refuses_the_rest(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """D's client leaves while P's writes are landing: vLLM aborts the request, D revokes
    its grants (the revoke waits out the write under way) and frees its blocks; P's next
    write is refused by D's engine, P fails the push and frees its blocks."""
    failed = hixl_counter(pd["prefill"], "failed_pushes")
    try:
        d_leg, pushes = _mid_push(pd, net, seed=60, d_timeout_s=ABORT_AFTER_S)
        result, _ = d_leg.result(60)
        aborted_at = result.finished_at
        assert hixl_counter(pd["prefill"], "pushes") == pushes, "the push ended before D left"
        wait_for(
            lambda: hixl_counter(pd["prefill"], "failed_pushes") > failed,
            PULL_TIMEOUT_S + MARGIN_S,
            "P's refused write",
        )
        detected = time.monotonic() - aborted_at
    finally:
        net.restore()
    assert result.failed, "an aborted request must not decode"
    assert "is not under grant" in pd["prefill"].log_tail(300)
    assert hixl_counter(pd["prefill"], "pushes") == pushes
    pd.concurrent_identical(seed=61)
    fault_report.record(
        "push, netns + TCP: D's client disconnects mid-push",
        "vLLM aborts the request; D revokes its grants once the write under way landed, and "
        "frees its blocks; P's next write is refused by D's engine (a revoked grant), P "
        "fails the push and frees; next request identical",
        detected,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )


def test_decode_killed_mid_push_then_restarted(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """D dies while P writes into its blocks: P's write fails, P ends the lease and frees
    its blocks at once; D, started again on the same ports, registers anew and the next
    request is pushed into it, token-identical."""
    failed = hixl_counter(pd["prefill"], "failed_pushes")
    try:
        d_leg, pushes = _mid_push(pd, net, seed=50)
        assert hixl_counter(pd["prefill"], "pushes") == pushes, "the push ended before D died"
        pd.servers.kill("decode")
        killed_at = time.monotonic()
        wait_for(
            lambda: hixl_counter(pd["prefill"], "failed_pushes") > failed,
            PULL_TIMEOUT_S + MARGIN_S,
            "P's failed push",
        )
        detected = time.monotonic() - killed_at
        freed = detected + wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
    finally:
        net.restore()
    assert freed < LEASE_S, f"P freed {freed:.2f} s after D died: it waited for the lease"
    assert d_leg.result(60)[0].failed
    assert hixl_counter(pd["prefill"], "pushes") == pushes
    pd.servers.wait_gone("decode")
    restarted = pd.servers.restart("decode")
    pd.concurrent_identical(seed=51)
    fault_report.record(
        "push, netns + TCP: D killed (SIGKILL) mid-push, then restarted",
        "P's write fails on the dead connection; P counts a failed push and frees its blocks "
        f"without waiting for the lease; D restarted in {restarted:.0f} s registers anew, "
        "next request pushed and identical",
        detected,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )


def test_restarted_prefill_behind_a_router_that_keeps_its_old_identity(
    pd: PushPair, router: RouterProcess, fault_report: FaultReport
) -> None:
    """P is killed and started again at the same addresses under a new engine id; the
    router still names the old one to D until P's next answer. D registers with whoever
    serves P's address (the engine the router sent P's leg to): no request fails."""
    warm = token_prompt(80, seed=30)
    assert through_router(router, warm).tokens == plain(pd["prefill"], warm, MAX_TOKENS)
    pd.servers.kill("prefill")
    pd.servers.wait_gone("prefill")
    restarted = pd.servers.restart("prefill", engine_id=f"push-p-{uuid.uuid4().hex[:8]}")
    prompts = [token_prompt(120, seed=31 + i) for i in range(3)]
    results = [through_router(router, prompt) for prompt in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None, result.error
        assert result.tokens == plain(pd["prefill"], prompt, MAX_TOKENS)
    fault_report.record(
        "push, netns + TCP: P killed and restarted under a new engine id, router keeps "
        "the old identity",
        "D registers with the engine now serving P's address (learned by a first-contact "
        "handshake); every request after the restart succeeds, token-identical",
        restarted,
        both_idle(pd.servers, IDLE_TIMEOUT_S),
    )
