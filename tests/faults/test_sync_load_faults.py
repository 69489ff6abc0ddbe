"""Reads in the step that computes the first token, under faults: real vLLM CPU servers on
the same-host transport, without the test delay, so that small reads do go in the step.

A failed synchronous read is reported to vLLM as the request's invalid blocks: under
kv_load_failure_policy=recompute D computes the prompt itself, token-identical, and D reads
asynchronously again until a read succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .deployments import (
    AUTH_TOKEN,
    HANDSHAKE_TIMEOUT_S,
    LEASE_S,
    PULL_TIMEOUT_S,
    connector_config,
)
from .fault_harness import (
    FaultReport,
    Servers,
    both_idle,
    hixl_counter,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_for,
    wait_idle,
)

MARGIN_S = 3.0


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path) -> Iterator[Servers]:
    common = {
        "transport": "auto",
        "lease_s": LEASE_S,
        "pull_timeout_s": PULL_TIMEOUT_S,
        "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        "auth_token": AUTH_TOKEN,
    }
    configs = {
        "prefill": connector_config("prefill", **common),
        "decode": connector_config("decode", "recompute", **common),
    }
    with Servers(model_dir, log_dir / "synchronous", configs) as servers:
        servers.start("prefill", "decode")
        yield servers


def counters(pd: Servers, *names: str) -> dict[str, float]:
    return {name: hixl_counter(pd["decode"], name) for name in names}


def settled_counters(pd: Servers, expected: dict[str, float]) -> dict[str, float]:
    """D's counters once they reached ``expected`` (metrics arrive a step after the event),
    or as they stand after the wait."""
    try:
        wait_for(lambda: counters(pd, *expected) == expected, 10.0, f"counters {expected}")
    except TimeoutError:
        pass
    return counters(pd, *expected)


def linked_and_reading_synchronously(pd: Servers, seed: int) -> None:
    """Reads until one lands in the step (the first from a P engine links it)."""
    for attempt in range(3):
        before = counters(pd, "pulls", "sync_loads")
        two_legs_identical(pd, seed + attempt)
        now = settled_counters(
            pd, {"pulls": before["pulls"] + 1, "sync_loads": before["sync_loads"] + 1}
        )
        if now["sync_loads"] == before["sync_loads"] + 1:
            return
    raise AssertionError("no read went in the step")


def next_read_synchronous(pd: Servers, seed: int) -> tuple[list[int], list[int], dict[str, Any]]:
    """A prompt, its plain tokens, and P's params for it, once D reads in the step from P."""
    linked_and_reading_synchronously(pd, seed)
    prompt = token_prompt(150, seed + 4)
    return prompt, plain(pd["prefill"], prompt), prefill_leg(pd["prefill"], prompt)


def recomputed_identical(
    pd: Servers, prompt: list[int], expected: list[int], params: dict[str, Any]
) -> float:
    """D's leg gives the plain tokens (its synchronous read failed: D computed the prompt
    itself); returns how long it took."""
    began = time.monotonic()
    result = run_decode(pd["decode"], prompt, params, 60.0)
    assert result.error is None, result.error
    assert result.tokens == expected
    return time.monotonic() - began


def test_the_first_read_links_p_and_the_next_ones_go_in_the_step(pd: Servers) -> None:
    before = counters(pd, "pulls", "sync_loads")
    two_legs_identical(pd, seed=21)
    first = settled_counters(pd, {"pulls": before["pulls"] + 1, "sync_loads": before["sync_loads"]})
    assert first == {"pulls": before["pulls"] + 1, "sync_loads": before["sync_loads"]}
    for seed in (22, 23):
        two_legs_identical(pd, seed)
    now = settled_counters(
        pd, {"pulls": before["pulls"] + 3, "sync_loads": before["sync_loads"] + 2}
    )
    assert now == {"pulls": before["pulls"] + 3, "sync_loads": before["sync_loads"] + 2}
    both_idle(pd)


def test_a_forged_lease_read_in_the_step_is_refused_and_recomputed(
    pd: Servers, fault_report: FaultReport
) -> None:
    prompt, expected, params = next_read_synchronous(pd, seed=30)
    params["remote_lease_id"] = (params["remote_lease_id"] + 7) % 2**64
    before = counters(pd, "refused_pulls", "sync_loads")
    took = recomputed_identical(pd, prompt, expected, params)
    now = settled_counters(
        pd, {"refused_pulls": before["refused_pulls"] + 1, "sync_loads": before["sync_loads"]}
    )
    assert now["refused_pulls"] == before["refused_pulls"] + 1
    assert now["sync_loads"] == before["sync_loads"]
    fault_report.record(
        "forged lease id on a read in the step (recompute policy)",
        "refused by P's lease word; vLLM recomputes the prompt on D, token-identical",
        took,
        both_idle(pd),
    )


def test_prefill_killed_before_a_read_in_the_step_d_recomputes(
    pd: Servers, fault_report: FaultReport
) -> None:
    prompt, expected, params = next_read_synchronous(pd, seed=40)
    before = counters(pd, "failed_pulls", "sync_loads")
    pd.kill("prefill")
    pd.wait_gone("prefill")  # so that the read meets a dead P, not one still dying
    took = recomputed_identical(pd, prompt, expected, params)
    assert took < PULL_TIMEOUT_S + MARGIN_S
    now = settled_counters(
        pd, {"failed_pulls": before["failed_pulls"] + 1, "sync_loads": before["sync_loads"]}
    )
    assert now["failed_pulls"] == before["failed_pulls"] + 1
    assert now["sync_loads"] == before["sync_loads"]
    wait_idle(pd["decode"])
    gone = leftover(pd["decode"])
    # A restarted P is linked afresh by an asynchronous read, then reads go in the step again.
    pd.restart("prefill")
    linked_and_reading_synchronously(pd, seed=50)
    fault_report.record(
        "P killed (SIGKILL) after D linked it, before a read in the step (recompute policy)",
        "the read fails at once; vLLM recomputes the prompt on D, token-identical; "
        "a restarted P is linked again by the next read",
        took,
        gone,
    )
