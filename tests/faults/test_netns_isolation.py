"""A silent, stopped or restarted P never stalls D: P and D each in their own network
namespace, TCP transport, D's reads otherwise as configured by default (small ones in the step
where that is safe), vllm-router in a third namespace reaching both over the management
network, while D streams a request of its own (the bystander).

Each case asserts the bystander's largest gap between two tokens (the step thread never
waits on a peer), how and when the stuck request ended, that the next request after the
fault cleared is token-identical to a plain run, and that nothing is left leased or held.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.demo.servers import RouterProcess
from hixl_connector.tools.netns import NetnsBed

from .deployments import (
    AUTH_TOKEN,
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT_S,
    LEASE_S,
    PULL_TIMEOUT_S,
    connector_config,
)
from .fault_harness import (
    FaultReport,
    Servers,
    both_idle,
    hixl_counter,
    in_namespaces,
    leftover,
    plain,
    prefill_leg,
    requests_in_flight,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_for,
)
from .isolation_harness import (
    BURST,
    SHUTDOWN_BOUND_S,
    Bystander,
    burst_of_reads,
    engine_resources,
    kept_pace,
    nothing_left_behind,
    recovered,
    router_in_namespace,
    shutdown_took,
    stuck_request,
    terminate,
    through_router,
    timed_out_in_isolation,
)


def idle_and_kept(pd: Servers, before: tuple[int, int]) -> str:
    """Waits until P and D hold no KV block and no request, and D's engine no more
    descriptors and threads than ``before`` the fault; returns what is left over."""
    left = both_idle(pd)
    fds, threads = nothing_left_behind(pd["decode"], before)
    return f"{left}; D's engine: {fds} fds, {threads} threads (before: {before[0]}, {before[1]})"


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[Servers]:
    common = {
        "transport": "tcp",
        "lease_s": LEASE_S,
        "heartbeat_s": HEARTBEAT_S,
        "pull_timeout_s": PULL_TIMEOUT_S,
        "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        "auth_token": AUTH_TOKEN,
    }
    configs = {
        "prefill": connector_config("prefill", **common, engine_port=free_port()),
        "decode": connector_config("decode", **common),
    }
    # One engine id across restarts, as a deployment that names its engines has: only the
    # incarnation tells D that P restarted.
    configs["prefill"]["engine_id"] = "prefill-isolation"
    # A graceful shutdown (vLLM's default aborts and kills the engine at once), so that the
    # shutdown tests below measure the connector's own.
    graceful = ["--shutdown-timeout", "30"]
    with in_namespaces(
        model_dir,
        log_dir / "netns_isolation",
        configs,
        net,
        {"prefill": graceful, "decode": graceful},
    ) as servers:
        servers.start("prefill", "decode")
        for seed in range(3):  # linked, and reads from P proven
            two_legs_identical(servers, seed)
        yield servers


@pytest.fixture(scope="module")
def router(pd: Servers, log_dir: Path, net: NetnsBed) -> Iterator[RouterProcess]:
    """vllm-router in its own namespace, sending each request to P, then D."""
    logs = log_dir / "netns_isolation"
    with router_in_namespace(net, pd["prefill"], pd["decode"], logs) as router:
        yield router


def test_black_holed_data_path(
    pd: Servers, router: RouterProcess, net: NetnsBed, fault_report: FaultReport
) -> None:
    """Every packet to and from P's engine port is dropped; its HTTP and side channel still
    answer. A request through the router: P prefills, D's read times out asynchronously, the
    router answers with an error; no step of D waits for it."""
    before = engine_resources(pd["decode"])
    engine_port = pd.config("prefill")["engine_port"]
    # Small reads from P, which D would read in the step over a same-host link, were loaded
    # asynchronously: they cross the network.
    assert hixl_counter(pd["decode"], "network_reads_async") >= 1
    assert hixl_counter(pd["decode"], "sync_loads") == 0
    prompt = token_prompt(150, seed=10)
    expected = plain(pd["prefill"], prompt)
    try:
        with Bystander(pd["decode"].url) as bystander:
            net.black_hole(engine_port)
            began = time.monotonic()
            result = through_router(router, prompt)
            took = result.finished_at - began
    finally:
        net.clear_black_hole()
    timed_out_in_isolation(bystander, result, took)
    began = time.monotonic()
    assert through_router(router, prompt).tokens == expected
    back = time.monotonic() - began
    fault_report.record(
        "netns + TCP: P's data path black-holed (side channel up), via the router, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; the stuck "
        f"read fails after pull_timeout_s, asynchronously, and the router answers an error; "
        f"the next request through the router is identical after {back:.1f} s",
        took,
        idle_and_kept(pd, before),
    )


def test_black_holed_side_channel(pd: Servers, net: NetnsBed, fault_report: FaultReport) -> None:
    """P's side channel goes silent after its leg: D reads the blocks over the data path as
    usual; its "done" never arrives, so P frees at lease expiry."""
    before = engine_resources(pd["decode"])
    side_port = pd.config("prefill")["side_channel_port"]
    try:
        with Bystander(pd["decode"].url) as bystander:
            prompt = token_prompt(150, seed=20)
            expected = plain(pd["prefill"], prompt)
            result, took = stuck_request(pd, 20, lambda: net.black_hole(side_port))
        assert result.tokens == expected, result.error
        wait_for(
            lambda: hixl_counter(pd["prefill"], "expired_leases") >= 1,
            LEASE_S + 10.0,
            "P's lease expiry",
        )
    finally:
        net.clear_black_hole()
    kept_pace(bystander)
    back = recovered(pd, 21)
    fault_report.record(
        "netns + TCP: P's side channel black-holed, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; the read "
        f"succeeds, token-identical; P frees at lease expiry; next request identical "
        f"after {back:.1f} s",
        took,
        idle_and_kept(pd, before),
    )


def test_partition_during_heartbeats(pd: Servers, net: NetnsBed, fault_report: FaultReport) -> None:
    """P and D partitioned (engine port and side channel black-holed) after P's leg: D's read
    waits past heartbeat_s, so its lease heartbeats go out into the partition and fail on
    their lanes; the read times out; P's lease expires and P frees the blocks."""
    before = engine_resources(pd["decode"])
    ports = (pd.config("prefill")["engine_port"], pd.config("prefill")["side_channel_port"])
    expired = hixl_counter(pd["prefill"], "expired_leases")
    lost = hixl_counter(pd["decode"], "failed_notifications")

    def partition() -> None:
        for port in ports:
            net.black_hole(port)

    try:
        with Bystander(pd["decode"].url) as bystander:
            result, took = stuck_request(pd, 25, partition)
        wait_for(
            lambda: hixl_counter(pd["prefill"], "expired_leases") > expired,
            LEASE_S + 10.0,
            "P's lease expiry",
        )
        wait_for(
            lambda: hixl_counter(pd["decode"], "failed_notifications") > lost,
            HANDSHAKE_TIMEOUT_S + 5.0,
            "D's lost heartbeats",
        )
    finally:
        net.clear_black_hole()
    timed_out_in_isolation(bystander, result, took)
    back = recovered(pd, 26)
    fault_report.record(
        "netns + TCP: P and D partitioned while D's read waits (heartbeats lost), D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; heartbeats "
        "fail on their lanes, the read fails after pull_timeout_s, P's lease expires; next "
        f"request identical after {back:.1f} s",
        took,
        idle_and_kept(pd, before),
    )


def test_stopped_prefill(pd: Servers, fault_report: FaultReport) -> None:
    """P is frozen (SIGSTOP) after its leg: its kernel still takes D's packets, nothing
    answers. D's read times out asynchronously; P resumes and serves the next request."""
    before = engine_resources(pd["decode"])
    try:
        with Bystander(pd["decode"].url) as bystander:
            result, took = stuck_request(pd, 30, lambda: pd.kill("prefill", signal.SIGSTOP))
    finally:
        pd.kill("prefill", signal.SIGCONT)
    timed_out_in_isolation(bystander, result, took)
    back = recovered(pd, 31)
    fault_report.record(
        "netns + TCP: P stopped (SIGSTOP) before D's read, D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; the stuck "
        f"read fails after pull_timeout_s, asynchronously; P resumed, next request "
        f"identical after {back:.1f} s",
        took,
        idle_and_kept(pd, before),
    )


@pytest.mark.parametrize("renamed", [False, True], ids=["same-engine-id", "new-engine-id"])
def test_restarted_prefill(pd: Servers, fault_report: FaultReport, renamed: bool) -> None:
    """P is killed and started again at the same addresses, under the same engine id (only
    its incarnation changes) or a new one, while D streams. D's first request after the
    restart names the new P: D drops the old link and links the new P on its pool, and no
    step of D waits for that. A request whose params P issued before the restart is refused,
    never read."""
    before = engine_resources(pd["decode"])
    prompt = token_prompt(150, seed=40)
    stale = prefill_leg(pd["prefill"], prompt)
    restarts = hixl_counter(pd["decode"], "peer_restarts")
    engine_id = f"{stale['remote_engine_id']}-renamed" if renamed else None
    with Bystander(pd["decode"].url) as bystander:
        pd.kill("prefill")
        pd.wait_gone("prefill")
        pd.restart("prefill", engine_id)
        back = recovered(pd, 41)
        began = time.monotonic()
        refused = run_decode(pd["decode"], prompt, stale, 60.0)
        refused_in = refused.finished_at - began
    kept_pace(bystander)
    fresh = prefill_leg(pd["prefill"], prompt)
    assert fresh["remote_engine_id"] == (engine_id or stale["remote_engine_id"])
    assert fresh["remote_incarnation"] != stale["remote_incarnation"]
    assert hixl_counter(pd["decode"], "peer_restarts") == restarts + 1
    assert refused.failed, "params of P's previous start must not be read"
    assert refused_in <= HANDSHAKE_TIMEOUT_S + 1.0, f"refused after {refused_in:.2f} s"
    run_decode(pd["decode"], prompt, fresh, 60.0)  # releases the lease the leg above took
    fault_report.record(
        "netns + TCP: P killed and restarted at the same address, "
        + ("a new engine id" if renamed else "same engine id")
        + ", D streaming",
        f"D's largest inter-token gap {bystander.largest_gap_s * 1000:.0f} ms; the first "
        "request after the restart names the new P: D drops the old link and "
        "links the new P on its pool, token-identical; params of P's previous start are "
        f"refused in {refused_in:.2f} s",
        back,
        idle_and_kept(pd, before),
    )


def test_prefill_shutdown_under_load_is_bounded(pd: Servers, fault_report: FaultReport) -> None:
    """P gets SIGTERM while D reads a burst of requests from it, P's blocks leased: P's
    connector shuts down within the bound, every D leg ends (read, or failed by policy),
    and a restarted P serves again."""
    pool, futures = burst_of_reads(pd, seed=50)
    with pool:
        wait_for(lambda: requests_in_flight(pd["decode"]) > 0, 30.0, "D's reads under way")
        gone = terminate(pd, "prefill")
        results = [future.result(timeout=60.0) for future in futures]
    took = shutdown_took(pd["prefill"])
    assert took < SHUTDOWN_BOUND_S, f"P's connector took {took:.2f} s to shut down"
    pd.restart("prefill")
    back = recovered(pd, 51)
    fault_report.record(
        f"P shut down (SIGTERM) while D reads a burst of {BURST} requests",
        f"P's connector shut down in {took:.2f} s, P gone in {gone:.1f} s; "
        f"{sum(r.failed for r in results)} of {BURST} reads failed by policy; a restarted P "
        f"serves the next request identically after {back:.1f} s",
        took,
        both_idle(pd),
    )


def test_decode_shutdown_under_load_is_bounded(
    pd: Servers, net: NetnsBed, fault_report: FaultReport
) -> None:
    """P's data path black-holed, so D's reads of a burst hang: 64 in flight in D's engine,
    the rest waiting for a row. D gets SIGTERM: vLLM drains (--shutdown-timeout), so the
    reads in flight end by pull_timeout_s, then those that waited for a row; then the
    connector shuts down within its bound and every process of D ends. Last in the module:
    D stays down."""
    engine_port = pd.config("prefill")["engine_port"]
    try:
        pool, futures = burst_of_reads(pd, 60, lambda: net.black_hole(engine_port))
        with pool:
            wait_for(lambda: requests_in_flight(pd["decode"]) >= BURST, 30.0, "D's burst admitted")
            gone = terminate(pd, "decode")
            results = [future.result(timeout=60.0) for future in futures]
    finally:
        net.clear_black_hole()
    took = shutdown_took(pd["decode"])
    assert took < SHUTDOWN_BOUND_S, f"D's connector took {took:.2f} s to shut down"
    assert all(result.failed for result in results)
    assert gone < 2 * PULL_TIMEOUT_S + SHUTDOWN_BOUND_S, f"D took {gone:.1f} s to end"
    fault_report.record(
        f"D shut down (SIGTERM) with {BURST} reads from a black-holed P (64 in flight)",
        f"D's connector shut down in {took:.2f} s, D gone in {gone:.1f} s; every read "
        "ended with its request",
        took,
        leftover(pd["prefill"]) + "; D: stopped",
    )
