"""The fault matrix on one P/D pair of real vLLM CPU servers (TCP transport, auth token):
the faults that need no timing (a D that never reads, forged params, a client gone at
once). The faults that land in the middle of a read are in test_netns.py, where P's side of
the link can be slowed.

One deployment (conftest's ``lease_pd``, shared with the hostile-input tests that run first)
serves the cases in file order. Each case bounds every wait, checks vLLM's own KV usage
gauge on both sides returns to idle, and records a row of the reliability table.
"""

from __future__ import annotations

import time

import pytest

from hixl_connector.tools.demo.client import RequestFailed

from .deployments import LEASE_S
from .fault_harness import (
    FaultReport,
    Servers,
    both_idle,
    decode_leg,
    hixl_counter,
    kv_usage,
    prefill_leg,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_idle,
)

# A failed receive reaches the client one engine step after the read was refused.
MARGIN_S = 3.0
# Forged params refused by P's lease word, which D reads in the same batch as the blocks.
READ_THEN_REFUSED = ("foreign", "wrong_lease")


@pytest.fixture(scope="module")
def pd(lease_pd: Servers) -> Servers:
    return lease_pd


def test_baseline_token_identical_and_idle(pd: Servers) -> None:
    pulls = hixl_counter(pd["decode"], "pulls")
    two_legs_identical(pd, seed=1)
    both_idle(pd)
    assert hixl_counter(pd["decode"], "pulls") == pulls + 1


def test_decode_never_pulls_lease_expiry_frees_prefill(
    pd: Servers, fault_report: FaultReport
) -> None:
    expired = hixl_counter(pd["prefill"], "expired_leases")
    prefill_leg(pd["prefill"], token_prompt(200, seed=2))
    assert kv_usage(pd["prefill"]) > 0, "P should hold the leased blocks"
    detected = wait_idle(pd["prefill"])
    assert detected >= LEASE_S / 2, "the blocks were freed before the lease ran out"
    assert hixl_counter(pd["prefill"], "expired_leases") == expired + 1
    fault_report.record(
        "D never pulls (only the prefill leg is sent)",
        f"P's lease ({LEASE_S:.0f} s) expires, blocks return to P's free pool",
        detected,
        both_idle(pd),
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
    assert detected < MARGIN_S
    fault_report.record(
        f"forged kv_transfer_params: {forge.replace('_', ' ')}",
        f"{expect}; the request fails with an error (policy fail), "
        + (
            "what was read alongside is discarded"
            if forge in READ_THEN_REFUSED
            else "nothing is read"
        ),
        detected,
        both_idle(pd),
    )
    two_legs_identical(pd, seed=30)


def test_client_gone_at_submission_frees_prefill_promptly(
    pd: Servers, fault_report: FaultReport
) -> None:
    prompt = token_prompt(120, seed=4)
    params = prefill_leg(pd["prefill"], prompt)
    # 600 tokens cannot be decoded in 50 ms on any machine, so the client always leaves first
    try:
        out = decode_leg(pd["decode"], prompt, params, timeout_s=0.05, max_tokens=600)
    except RequestFailed:
        out = None
    assert out is None, f"the client should have given up, got {len(out.token_ids)} tokens"
    detected = wait_idle(pd["prefill"])
    assert detected < LEASE_S, "P waited for lease expiry instead of being told"
    fault_report.record(
        "client disconnects from D at submission",
        "vLLM aborts the request and its rejection cleanup makes D send 'release': P frees at once",
        detected,
        both_idle(pd),
    )
    two_legs_identical(pd, seed=40)
