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

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hixl_connector.connector.push.status import PUSH_CHECK_S
from hixl_connector.tools.demo.processes import visit_process_group
from hixl_connector.tools.demo.servers import RouterProcess, VllmServer
from hixl_connector.tools.netns import NetnsBed

from .deployments import HANDSHAKE_TIMEOUT_S, LEASE_S, PULL_TIMEOUT_S, PUSH_TIMEOUT_S
from .fault_harness import (
    FaultReport,
    both_idle,
    hixl_counter,
    in_namespaces,
    kv_usage,
    plain,
    requests_in_flight,
    token_prompt,
    wait_for,
    wait_idle,
)
from .isolation_harness import Bystander, kept_pace, router_in_namespace, through_router
from .push_harness import (
    MAX_TOKENS,
    PushPair,
    connector_config,
    mid_push,
    still_pushing,
    stuck,
)

# D's client gives up this long after it sent D's leg: after P's prefill, within the push.
ABORT_AFTER_S = 1.0
# D's failed receive after P died: D's own timeout, then the revoke waits out what P's slowed
# link still delivers of the write under way.
MARGIN_S = 3.0
# P learns of a dead D from its connection (a reset), well within a write's own limit.
DEAD_PEER_SEEN_S = 1.0
# After a healed cut, a request this much later: past the leases, timeouts and status
# questions of this deployment many times over.
LATER_S = 60.0
# P's leg of the aborted prompt: its client gives up after this while P's engine is frozen,
# and P's API server has sent the abort this much later.
ABORTED_P_LEG_S = 0.3
ABORT_SENT_S = 0.3
# D asks P about a push it waited PUSH_CHECK_S for, then every PUSH_CHECK_S.
HEARD_WITHIN_S = 2 * PUSH_CHECK_S + 0.5
# P's side of the data link under load: 8 requests' blocks (5 of 32 KiB each) take about a
# second to write, so D always waits on a few, each well within PULL_TIMEOUT_S.
UNDER_LOAD_RATE = "10mbit"


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[PushPair]:
    configs = {role: connector_config(role) for role in ("prefill", "decode")}
    configs["prefill"]["kv_connector_extra_config"]["engine_port"] = 0
    with in_namespaces(model_dir, log_dir / "netns_push", configs, net) as servers:
        pair = PushPair(servers)
        try:
            servers.start("prefill", "decode")
            pair.learn_identity(seed=0)
            pair.concurrent_identical(seed=1)  # linked both ways, pushes proven
            yield pair
        finally:
            pair.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def router(pd: PushPair, log_dir: Path, net: NetnsBed) -> Iterator[RouterProcess]:
    """vllm-router in its own namespace, sending each request to P, then D."""
    with router_in_namespace(net, pd["prefill"], pd["decode"], log_dir / "netns_push") as router:
        yield router


def test_prefill_stopped_before_its_push_d_gives_up_on_its_own(
    pd: PushPair, fault_report: FaultReport
) -> None:
    gave_up = given_up(pd)
    pushes = hixl_counter(pd["prefill"], "pushes")
    with Bystander(pd["decode"].url) as bystander:
        result, took = stuck(pd, seed=10, d_timeout_s=60.0)
    kept_pace(bystander)
    assert result.failed, "a request P never pushed must not decode"
    assert took <= PUSH_TIMEOUT_S + 1.5, f"the stuck request took {took:.2f} s"
    # A stopped P answers no status question either: D judges it gone, or times out first.
    assert given_up(pd) == gave_up + 1
    pd.concurrent_identical(seed=11)
    # The stuck request's push never landed: D had given up (P forgot the registration, or
    # D's engine refused the write under the revoked grant).
    assert hixl_counter(pd["prefill"], "pushes") == pushes + 1
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P stopped (SIGSTOP) after D registered, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; D gives up "
        "after push_timeout_s on its own, revokes its grants and fails the request; P, "
        "resumed, writes nothing into blocks D took back; next request identical",
        took,
    )


def engine_core(server: VllmServer) -> int:
    """The pid of ``server``'s engine core (its own process in the server's group)."""
    assert server.pid is not None, f"{server.name} is not started"
    names = visit_process_group(server.pid, lambda proc: (proc / "comm").read_text())
    cores = [pid for pid, name in names.items() if name.startswith("VLLM::EngineCor")]
    assert cores, f"no engine core process in {server.name}'s group"
    return cores[0]


def record_idle(
    fault_report: FaultReport, pd: PushPair, case: str, outcome: str, detected_s: float
) -> None:
    """Records the case's reliability row once P and D hold no KV block and no request
    again (every case here ends so), with what is left over."""
    fault_report.record(case, outcome, detected_s, both_idle(pd.servers))


def given_up(pd: PushPair) -> float:
    """Requests D stopped waiting for: its own timeout, or a P it judged gone."""
    return sum(hixl_counter(pd["decode"], name) for name in ("push_timeouts", "push_peers_lost"))


def test_prefill_aborted_before_it_computes_d_hears_at_once(
    pd: PushPair, fault_report: FaultReport
) -> None:
    """D registered; P's leg is aborted before P computes it (its client gives up while P's
    engine core is frozen; on resume the engine takes the request and its abort together).
    P's scheduler finishes it without a lease, P's worker keeps why, and D hears it at its
    next status question: the request fails well before push_timeout_s, counted as heard."""
    decode = pd["decode"]
    heard = hixl_counter(decode, "push_failures_heard")
    timeouts = hixl_counter(decode, "push_timeouts")
    engine = engine_core(pd["prefill"])
    for attempt in range(3):  # until the abort beats P's prefill (it nearly always does)
        prompt = token_prompt(150, seed=90 + attempt)
        request_id = uuid.uuid4().hex
        registered = hixl_counter(decode, "push_registrations")
        d_leg = pd.d_leg(prompt, request_id)
        pd.registered(registered)
        os.kill(engine, signal.SIGSTOP)
        try:
            p_result, _ = pd.p_leg(prompt, request_id, timeout_s=ABORTED_P_LEG_S).result(30)
            time.sleep(ABORT_SENT_S)  # P's API server sends the abort after the request
        finally:
            os.kill(engine, signal.SIGCONT)
        resumed = time.monotonic()
        assert p_result.failed, "P's client was to give up while P's engine was frozen"
        d_result, _ = d_leg.result(60)
        if d_result.failed:
            break
    took = d_result.finished_at - resumed
    assert d_result.failed, "P computed the prompt before its abort in every attempt"
    assert hixl_counter(decode, "push_failures_heard") == heard + 1
    assert hixl_counter(decode, "push_timeouts") == timeouts
    assert took < HEARD_WITHIN_S, f"D failed it {took:.2f} s after P resumed"
    pd.concurrent_identical(seed=95)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P's leg aborted before P computes it (D registered)",
        f"P finishes the prompt without a lease and keeps why; D hears it at its next status "
        f"question and fails the request {took:.2f} s after P resumed (push_timeout_s: "
        f"{PUSH_TIMEOUT_S:g} s); next request identical",
        took,
    )


def test_data_link_cut_mid_push_heals_for_the_next_request(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """The data link between P and D goes down while P writes, D streaming a request of its
    own: P's write times out and its link to D is lost for good (LLM-DataDist: a timed-out
    link cannot be used again), D's request fails, and D's stream keeps its pace. Once the
    link is back, the next request is pushed, token-identical: D heard P was gone (or that
    P lost the link) and links again, rather than registering over a link P can no longer
    write on; so is a request well after (past every timer of this deployment)."""
    failed = hixl_counter(pd["prefill"], "failed_pushes")
    with Bystander(pd["decode"].url) as bystander:
        try:
            push = mid_push(pd, net, seed=70)
            net.set_data_link(False)
            cut_at = time.monotonic()
            result, _ = push.d_leg.result(60)
            wait_for(
                lambda: hixl_counter(pd["prefill"], "failed_pushes") > failed,
                PULL_TIMEOUT_S + MARGIN_S,
                "P's timed-out write",
            )
        finally:
            net.set_data_link(True)
            net.restore()
    kept_pace(bystander)
    detected = result.finished_at - cut_at
    assert result.failed, "a request whose push never finished must not decode"
    assert "LLM_TIMEOUT" in pd["prefill"].log_tail(300), "P's write did not time out"
    began = time.monotonic()
    pd.concurrent_identical(seed=71)
    healed = time.monotonic() - began
    time.sleep(LATER_S)
    pd.concurrent_identical(seed=72)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P-D data link down mid-push, then up again, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; D fails the "
        f"request {detected:.1f} s after the cut (P gone, or P's own timeout); P's write "
        "times out and its link is lost; D links again for the next request, pushed and "
        f"identical ({healed:.1f} s), and for one {LATER_S:.0f} s later",
        detected,
    )


def test_decode_aborted_while_waiting_for_the_push_refuses_the_late_write(
    pd: PushPair, fault_report: FaultReport
) -> None:
    """The client gives up on D's leg: vLLM aborts it, D revokes and frees at once. P,
    resumed within D's wait, still holds the registration and pushes: D's engine refuses
    every byte (the write names a revoked grant)."""
    refused = hixl_counter(pd["prefill"], "failed_pushes")
    result, took = stuck(pd, seed=20, d_timeout_s=1.0)
    assert result.failed, "an aborted request must not decode"
    wait_for(
        lambda: hixl_counter(pd["prefill"], "failed_pushes") >= refused + 1,
        10.0,
        "P's refused push",
    )
    assert "is not under grant" in pd["prefill"].log_tail(300)
    pd.concurrent_identical(seed=21)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: D's client disconnects while D waits for P's push",
        "vLLM aborts the request; D revokes its grants and frees its blocks; P's push, "
        "later, is refused by D's engine (it names a revoked grant); next request identical",
        took,
    )


def test_prefill_killed_mid_push_d_fails_on_its_own(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """P dies with D's blocks half written: no word ever comes, D gives up within
    push_timeout_s (at its next status question, which P's host refuses), revokes (after the
    write under way ended with P's connection) and fails the request; D keeps streaming its
    own; a restarted P serves the next request."""
    gave_up = given_up(pd)
    with Bystander(pd["decode"].url) as bystander:
        try:
            push = mid_push(pd, net, seed=40)
            still_pushing(pd, push, "P died")
            pd.servers.kill("prefill")
            killed_at = time.monotonic()
            result, _ = push.d_leg.result(60)
            detected = result.finished_at - killed_at
        finally:
            net.restore()
    kept_pace(bystander)
    assert result.failed, "a request whose push P never finished must not decode"
    assert detected <= PUSH_TIMEOUT_S + MARGIN_S, f"D failed it {detected:.2f} s after P died"
    # This request, and any other D had under way with that P (a first contact telling it
    # to free a request D let go, say), which the dead P's host refuses at once.
    assert given_up(pd) >= gave_up + 1
    pd.servers.wait_gone("prefill")
    restarted = pd.servers.restart("prefill", engine_id=f"push-p-{uuid.uuid4().hex[:8]}")
    pd.learn_identity(seed=41)
    pd.concurrent_identical(seed=42)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P killed (SIGKILL) mid-push, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; no word comes; "
        "at D's next status question P's host refuses the side channel, so D judges P gone "
        "(else its own push_timeout_s), revokes its grants and fails the request; P "
        f"restarted in {restarted:.0f} s, next request identical",
        detected,
    )


def test_prefill_killed_under_load_behind_the_router_frees_d_at_once(
    pd: PushPair, net: NetnsBed, router: RouterProcess, fault_report: FaultReport
) -> None:
    """16 requests through vllm-router, 8 at a time, P's writes slowed so that D always waits
    on some; P's process group is SIGKILLed once D holds four or more. Every request D holds
    waits on that P: D fails them together (P's host refuses D's side channel at once), not
    one after another and not at push_timeout_s, so D is idle again within one handshake timeout;
    nothing is leaked, and after P's restart requests are served, token-identical."""
    decode = pd["decode"]
    timeouts = hixl_counter(decode, "push_timeouts")
    lost = hixl_counter(decode, "push_peers_lost")
    registered = hixl_counter(decode, "push_registrations")
    prompts = [token_prompt(160, seed=80 + i) for i in range(16)]
    held: list[tuple[float, float]] = []  # (s after the kill, D's KV usage)
    net.throttle(UNDER_LOAD_RATE, burst="16kb")
    try:
        with ThreadPoolExecutor(8) as clients:
            futures = [clients.submit(through_router, router, p) for p in prompts]
            wait_for(
                lambda: (
                    hixl_counter(decode, "push_registrations") >= registered + 4
                    and requests_in_flight(decode) >= 4
                ),
                30.0,
                "four requests on D waiting for P's pushes",
            )
            held.append((0.0, kv_usage(decode)))
            pd.servers.kill("prefill")
            killed_at = time.monotonic()
            while requests_in_flight(decode) > 0 or kv_usage(decode) > 0:
                since = time.monotonic() - killed_at
                assert since < PUSH_TIMEOUT_S * 4, f"D still busy {since:.1f} s after the kill"
                held.append((since, kv_usage(decode)))
                time.sleep(0.05)
            back = time.monotonic() - killed_at
            results = [f.result(120) for f in futures]
    finally:
        net.restore()
    served = sum(r.error is None for r in results)
    assert served < len(prompts), "P died under load: some requests must have failed"
    assert back <= HANDSHAKE_TIMEOUT_S, f"D was idle again only {back:.2f} s after P died"
    assert hixl_counter(decode, "push_peers_lost") > lost, "D did not judge P gone"
    assert hixl_counter(decode, "push_timeouts") == timeouts, "D waited out push_timeout_s"
    pd.servers.wait_gone("prefill")
    restarted = pd.servers.restart("prefill", engine_id=f"push-p-{uuid.uuid4().hex[:8]}")
    after = [token_prompt(120, seed=100 + i) for i in range(3)]
    for prompt in after:
        result = through_router(router, prompt)
        assert result.error is None, result.error
        assert result.tokens == plain(pd["prefill"], prompt, MAX_TOKENS)
    pd.learn_identity(seed=103)
    timeline = ", ".join(
        f"{usage:.1%} at +{t:.2f} s" for t, usage in held[:: max(1, len(held) // 6)]
    )
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P killed (SIGKILL) under load behind vllm-router, 16 requests "
        "at concurrency 8",
        f"{served}/16 served; every request waiting on P failed together once P's host "
        f"refused D's side channel; D idle {back:.2f} s after the kill (its KV: {timeline}); P "
        f"restarted in {restarted:.0f} s, next requests through the router identical",
        back,
    )


def test_decode_aborted_mid_push_refuses_the_rest(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """D's client leaves while P's writes are landing: vLLM aborts the request, D revokes
    its grants (the revoke waits out the write under way) and frees its blocks; P's next
    write is refused by D's engine, P fails the push and frees its blocks."""
    failed = hixl_counter(pd["prefill"], "failed_pushes")
    log_before = pd["prefill"].log_path.stat().st_size
    try:
        push = mid_push(pd, net, seed=60, d_timeout_s=ABORT_AFTER_S)
        result, _ = push.d_leg.result(60)
        aborted_at = result.finished_at
        assert aborted_at > push.prefilled_at, "D's client left before P's writes began"
        still_pushing(pd, push, "D's client left")
        wait_for(
            lambda: hixl_counter(pd["prefill"], "failed_pushes") > failed,
            PULL_TIMEOUT_S + MARGIN_S,
            "P's refused write",
        )
        detected = time.monotonic() - aborted_at
    finally:
        net.restore()
    assert result.failed, "an aborted request must not decode"
    with pd["prefill"].log_path.open("rb") as log:
        log.seek(log_before)
        assert b"is not under grant" in log.read(), "P's write was not refused by D's engine"
    assert hixl_counter(pd["prefill"], "pushes") == push.pushes_before
    pd.concurrent_identical(seed=61)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: D's client disconnects mid-push",
        "vLLM aborts the request; D revokes its grants once the write under way landed, and "
        "frees its blocks; P's next write is refused by D's engine (a revoked grant), P "
        "fails the push and frees; next request identical",
        detected,
    )


def test_decode_killed_mid_push_then_restarted(
    pd: PushPair, net: NetnsBed, fault_report: FaultReport
) -> None:
    """D dies while P writes into its blocks: P's write fails on the dead connection at
    once (not at its own pull_timeout_s), P ends the lease and frees its blocks; D, started
    again on the same ports, registers anew and the next request is pushed into it,
    token-identical."""
    failed = hixl_counter(pd["prefill"], "failed_pushes")
    try:
        push = mid_push(pd, net, seed=50)
        still_pushing(pd, push, "D died")
        pd.servers.kill("decode")
        killed_at = time.monotonic()
        wait_for(
            lambda: hixl_counter(pd["prefill"], "failed_pushes") > failed,
            PULL_TIMEOUT_S + MARGIN_S,
            "P's failed push",
        )
        detected = time.monotonic() - killed_at
        freed = detected + wait_idle(pd["prefill"])
    finally:
        net.restore()
    # A write P had not seen fail would end at its own limit, pull_timeout_s after it began
    # (before the kill): well after this.
    assert detected < DEAD_PEER_SEEN_S, f"P saw D's death after {detected:.2f} s"
    assert freed < LEASE_S, f"P freed {freed:.2f} s after D died: it waited for the lease"
    assert push.d_leg.result(60)[0].failed
    assert hixl_counter(pd["prefill"], "pushes") == push.pushes_before
    pd.servers.wait_gone("decode")
    restarted = pd.servers.restart("decode")
    pd.concurrent_identical(seed=51)
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: D killed (SIGKILL) mid-push, then restarted",
        "P's write fails on the dead connection; P counts a failed push and frees its blocks "
        f"without waiting for the lease; D restarted in {restarted:.0f} s registers anew, "
        "next request pushed and identical",
        detected,
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
    record_idle(
        fault_report,
        pd,
        "push, netns + TCP: P killed and restarted under a new engine id, router keeps "
        "the old identity",
        "D registers with the engine now serving P's address (learned by a first-contact "
        "handshake); every request after the restart succeeds, token-identical",
        restarted,
    )
