"""The fault matrix on one P/D pair of real vLLM CPU servers (TCP transport, auth token).

One deployment (conftest's ``lease_pd``, shared with the hostile-input tests that run first)
serves the cases in file order; the cases that kill a server come last (P is restarted in
place, D is not). Each case bounds every wait, checks vLLM's own KV usage gauge
on both sides returns to idle, and records a row of the reliability table.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from .deployments import HANDSHAKE_TIMEOUT_S, LEASE_S, PULL_DELAY_S, PULL_TIMEOUT_S
from .fault_harness import (
    FaultReport,
    LegResult,
    Servers,
    both_idle,
    hixl_counter,
    kv_usage,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_idle,
)

IDLE_TIMEOUT_S = LEASE_S + 10.0
# A failed receive reaches the client one engine step after the pull gave up.
MARGIN_S = 3.0
QUEUED_BEHIND_KILL = 10
# Forged params refused by P's lease word, which D reads in the same batch as the blocks.
READ_THEN_REFUSED = ("foreign", "wrong_lease")


@pytest.fixture(scope="module")
def pd(lease_pd: Servers) -> Servers:
    return lease_pd


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def decode_in_background(
    pool: ThreadPoolExecutor, pd: Servers, prompt: list[int], params: dict[str, Any]
) -> Future[LegResult]:
    future = pool.submit(run_decode, pd["decode"], prompt, params, 60.0)
    time.sleep(PULL_DELAY_S / 3)  # D has checked the lease and waits to read
    return future


def test_baseline_token_identical_and_idle(pd: Servers) -> None:
    pulls = hixl_counter(pd["decode"], "pulls")
    two_legs_identical(pd, seed=1)
    both_idle(pd, IDLE_TIMEOUT_S)
    assert hixl_counter(pd["decode"], "pulls") == pulls + 1


def test_decode_never_pulls_lease_expiry_frees_prefill(
    pd: Servers, fault_report: FaultReport
) -> None:
    expired = hixl_counter(pd["prefill"], "expired_leases")
    prefill_leg(pd["prefill"], token_prompt(200, seed=2))
    assert kv_usage(pd["prefill"]) > 0, "P should hold the leased blocks"
    detected = wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
    assert detected >= LEASE_S / 2, "the blocks were freed before the lease ran out"
    assert hixl_counter(pd["prefill"], "expired_leases") == expired + 1
    fault_report.record(
        "D never pulls (only the prefill leg is sent)",
        f"P's lease ({LEASE_S:.0f} s) expires, blocks return to P's free pool",
        detected,
        both_idle(pd, IDLE_TIMEOUT_S),
    )


@pytest.mark.parametrize(
    "forge,expect",
    [
        ("foreign", "refused: blocks outside the lease"),
        ("out_of_range", "refused: block ids beyond P's cache"),
        ("wrong_lease", "refused: unknown lease"),
        ("bad_type", "refused: invalid kv_transfer_params"),
    ],
)
def test_forged_block_ids_are_refused(
    pd: Servers, fault_report: FaultReport, forge: str, expect: str
) -> None:
    prompt = token_prompt(100, seed=3)
    params = prefill_leg(pd["prefill"], prompt)
    blocks = params["remote_block_ids"][0]
    if forge == "foreign":
        params["remote_block_ids"] = [[b + 40 for b in blocks]]
    elif forge == "out_of_range":
        params["remote_block_ids"] = [[10**9 + i for i in range(len(blocks))]]
    elif forge == "wrong_lease":
        params["remote_lease_id"] = (params["remote_lease_id"] + 7) % 2**64
    else:
        params["remote_block_ids"] = [["x"] * len(blocks)]
    refused = hixl_counter(pd["decode"], "refused_pulls")
    started = time.monotonic()
    result = run_decode(pd["decode"], prompt, params, 30.0)
    detected = result.finished_at - started
    assert result.failed, f"forged params ({forge}) were not refused: {result.tokens}"
    if forge != "bad_type":  # params that cannot even be parsed never reach P
        assert hixl_counter(pd["decode"], "refused_pulls") == refused + 1
    assert detected < PULL_DELAY_S + MARGIN_S
    fault_report.record(
        f"forged kv_transfer_params: {forge.replace('_', ' ')}",
        f"{expect}; the request fails with an error (policy fail), "
        + (
            "what was read alongside is discarded"
            if forge in READ_THEN_REFUSED
            else "nothing is read"
        ),
        detected,
        both_idle(pd, IDLE_TIMEOUT_S),
    )
    two_legs_identical(pd, seed=30)


def test_client_abort_frees_prefill_promptly(pd: Servers, fault_report: FaultReport) -> None:
    for when, timeout_s in (("at submission", 0.05), ("during the pull", PULL_DELAY_S / 2)):
        prompt = token_prompt(120, seed=4 if when == "at submission" else 5)
        params = prefill_leg(pd["prefill"], prompt)
        result = run_decode(pd["decode"], prompt, params, timeout_s)
        assert result.failed, "the client should have given up"
        detected = wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
        assert detected < LEASE_S, "P waited for lease expiry instead of being told"
        fault_report.record(
            f"client disconnects from D {when}",
            "vLLM aborts the request and its rejection cleanup makes D send 'release': P frees "
            "at once; a read still in flight finds its lease word cleared (stale), nothing decodes",
            detected,
            both_idle(pd, IDLE_TIMEOUT_S),
        )
    two_legs_identical(pd, seed=40)


def test_prefill_frozen_during_pull(
    pd: Servers, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    prompt = token_prompt(160, seed=6)
    params = prefill_leg(pd["prefill"], prompt)
    future = decode_in_background(pool, pd, prompt, params)
    pd.kill("prefill", signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        result = future.result(timeout=PULL_TIMEOUT_S + 30)
    finally:
        pd.kill("prefill", signal.SIGCONT)
    detected = result.finished_at - stopped_at
    assert result.failed, "a pull from a frozen P must not succeed"
    assert detected < PULL_DELAY_S + PULL_TIMEOUT_S + MARGIN_S
    left = both_idle(pd, IDLE_TIMEOUT_S)
    two_legs_identical(pd, seed=60)
    fault_report.record(
        "P frozen (SIGSTOP) during a pull",
        "D's read times out (pull_timeout_s), the request fails; after SIGCONT P's lease "
        "expires and later requests work",
        detected,
        left,
    )


def test_prefill_killed_during_pull_then_restarted(
    pd: Servers, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    prompt = token_prompt(160, seed=7)
    params = prefill_leg(pd["prefill"], prompt)
    future = decode_in_background(pool, pd, prompt, params)
    pd.kill("prefill", signal.SIGKILL)
    killed_at = time.monotonic()
    result = future.result(timeout=PULL_TIMEOUT_S + 30)
    detected = result.finished_at - killed_at
    assert result.failed, "a pull from a dead P must not succeed"
    assert detected < PULL_DELAY_S + PULL_TIMEOUT_S + MARGIN_S
    wait_idle(pd["decode"], IDLE_TIMEOUT_S)
    fault_report.record(
        "P killed (SIGKILL) during a pull",
        "D's read fails (connection reset), the request fails with an error",
        detected,
        leftover(pd["decode"]) + "; P: process gone",
    )

    restart_s = pd.restart("prefill")
    began = time.monotonic()
    handshakes = hixl_counter(pd["decode"], "failed_handshakes")
    new_params = prefill_leg(pd["prefill"], prompt)
    assert new_params["remote_engine_id"] != params["remote_engine_id"]
    assert new_params["remote_port"] == params["remote_port"]
    result = run_decode(pd["decode"], prompt, new_params, 60.0)
    assert result.error is None, result.error
    assert result.tokens == plain(pd["prefill"], prompt)
    assert hixl_counter(pd["decode"], "failed_handshakes") == handshakes
    fault_report.record(
        "P restarted with the same address, new engine",
        "D sees the new engine id, drops the old link, handshakes and links again; "
        f"the first request is token-identical (P restart took {restart_s:.0f} s)",
        result.finished_at - began,
        both_idle(pd, IDLE_TIMEOUT_S),
    )


def test_requests_queued_behind_a_killed_prefill_all_end_within_one_timeout(
    pd: Servers, fault_report: FaultReport
) -> None:
    # Two reads in flight (one per transfer thread), ten queued behind them on D.
    prompts = [token_prompt(120, seed=60 + i) for i in range(QUEUED_BEHIND_KILL + 2)]
    legs = [prefill_leg(pd["prefill"], prompt) for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(run_decode, pd["decode"], prompt, params, 60.0)
            for prompt, params in zip(prompts, legs, strict=True)
        ]
        time.sleep(PULL_DELAY_S / 3)  # the first reads wait out the delay, the rest queue
        pd.kill("prefill", signal.SIGKILL)
        killed_at = time.monotonic()
        results = [future.result(timeout=60) for future in futures]
    ended = max(result.finished_at for result in results) - killed_at
    assert all(result.failed for result in results), "a read from a dead P must not succeed"
    # The reads in flight fail once their delay ends; the first queued request then waits one
    # handshake timeout for the dead P, and every one behind it fails at once.
    assert ended < PULL_DELAY_S + HANDSHAKE_TIMEOUT_S + 1.0, f"the last ended {ended:.1f} s after"
    wait_idle(pd["decode"], IDLE_TIMEOUT_S)
    fault_report.record(
        f"P killed (SIGKILL) with {QUEUED_BEHIND_KILL} requests queued on D",
        "the first request after the kill waits one handshake timeout; D remembers the failure "
        "and the rest fail at once (not one timeout each)",
        ended,
        leftover(pd["decode"]) + "; P: process gone",
    )
    pd.restart("prefill")
    two_legs_identical(pd, seed=70)


def test_decode_killed_after_prefill(
    pd: Servers, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    expired = hixl_counter(pd["prefill"], "expired_leases")
    prompt = token_prompt(200, seed=8)
    params = prefill_leg(pd["prefill"], prompt)
    future = decode_in_background(pool, pd, prompt, params)
    pd.kill("decode", signal.SIGKILL)
    killed_at = time.monotonic()
    wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
    detected = time.monotonic() - killed_at
    assert future.result(timeout=30).failed
    assert hixl_counter(pd["prefill"], "expired_leases") == expired + 1
    fault_report.record(
        "D killed (SIGKILL) after P prefilled",
        "heartbeats stop, P's lease expires and its blocks return to the free pool",
        detected,
        leftover(pd["prefill"]) + "; D: process gone",
    )
