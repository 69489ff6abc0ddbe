"""What the push-mode fault tests (test_netns_push.py) share: P and D in push mode, their
legs sent as vllm-router sends them once P answered with its push identity (both at once,
one X-Request-Id, D naming P by address only), and the two ways a fault is made to land:
before P's prefill (P stopped) and in the middle of P's writes (P's link slowed)."""

from __future__ import annotations

import signal
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    RequestFailed,
    push_identity,
    send_leg,
)
from hixl_connector.tools.netns import NetnsBed

from .deployments import (
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT_S,
    LEASE_S,
    PULL_TIMEOUT_S,
    PUSH_TIMEOUT_S,
)
from .deployments import connector_config as base_config
from .fault_harness import (
    SERVED_MODEL_NAME,
    LegResult,
    Servers,
    hixl_counter,
    plain,
    token_prompt,
    wait_for,
    wait_idle,
)

MAX_TOKENS = 16
# P's side of the data link while a fault lands mid-push: a 160-token prompt's blocks (5 of
# 32 KiB) take about 2 s to write, under PUSH_TIMEOUT_S, so an unfaulted push would land.
MID_PUSH_RATE = "640kbit"
INTO_THE_PUSH_S = 0.5


def connector_config(role: str) -> dict[str, Any]:
    return base_config(
        role,
        transfer_mode="push",
        transport="tcp",
        lease_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
        pull_timeout_s=PULL_TIMEOUT_S,
        push_timeout_s=PUSH_TIMEOUT_S,
        handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
    )


def leg(
    url: str, prompt: list[int], params: dict[str, Any], request_id: str, timeout_s: float
) -> tuple[LegResult, dict[str, Any] | None]:
    """One leg, with the request id both legs share; and P's answer."""
    try:
        out = send_leg(
            url,
            prompt,
            params,
            request_id,
            model=SERVED_MODEL_NAME,
            max_tokens=1 if params.get("do_remote_decode") else MAX_TOKENS,
            timeout_s=timeout_s,
        )
    except RequestFailed as e:
        return LegResult(None, str(e), time.monotonic()), None
    if out.finish_reason == "error":
        return LegResult(out.token_ids, "finish_reason=error", time.monotonic()), None
    return LegResult(out.token_ids, None, time.monotonic()), out.kv_transfer_params


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
        self.identity = push_identity(answer)
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


def stuck(pd: PushPair, seed: int, d_timeout_s: float) -> tuple[LegResult, float]:
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
        if d_timeout_s < PUSH_TIMEOUT_S:  # the client gave up: D aborts after that
            wait_idle(pd["decode"], 10.0)  # revoked and reported: vLLM freed D's blocks
    finally:
        pd.servers.kill("prefill", signal.SIGCONT)
    p_result, _ = p_leg.result(120)
    assert p_result.error is None, p_result.error
    return d_result, took


@dataclass(frozen=True)
class MidPush:
    """A push under way: D's leg, how many pushes P had finished before, and when P's leg
    answered (its prefill done, its writes crawling)."""

    d_leg: Future[tuple[LegResult, dict[str, Any] | None]]
    pushes_before: float
    prefilled_at: float


def mid_push(pd: PushPair, net: NetnsBed, seed: int, d_timeout_s: float = 60.0) -> MidPush:
    """D registered and P's prefill done, its writes crawling over the slowed link,
    INTO_THE_PUSH_S in (D's client gives up after ``d_timeout_s``). The caller restores the
    link."""
    prompt = token_prompt(160, seed)
    request_id = uuid.uuid4().hex
    registered = hixl_counter(pd["decode"], "push_registrations")
    d_leg = pd.d_leg(prompt, request_id, timeout_s=d_timeout_s)
    pd.registered(registered)
    pushes = hixl_counter(pd["prefill"], "pushes")
    net.throttle(MID_PUSH_RATE)
    p_result, _ = pd.p_leg(prompt, request_id).result(60)
    assert p_result.error is None, p_result.error
    prefilled_at = p_result.finished_at
    time.sleep(max(0.0, prefilled_at + INTO_THE_PUSH_S - time.monotonic()))
    return MidPush(d_leg, pushes, prefilled_at)


def still_pushing(pd: PushPair, push: MidPush, until: str) -> None:
    """P has not finished ``push`` yet: the fault (``until``, e.g. "P died") landed in the
    middle of its writes, not after them."""
    assert hixl_counter(pd["prefill"], "pushes") == push.pushes_before, (
        f"the push ended before {until}"
    )
