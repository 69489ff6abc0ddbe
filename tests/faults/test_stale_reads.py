"""Stale reads are impossible, and incompatible peers are refused: real vLLM servers.

Stale read: D renews no lease after the first heartbeat (its heartbeat period is far longer
than P's lease) and waits longer than P's lease between the lease check and the read. P's
lease expires, its blocks are reused by other requests (a tiny KV cache makes reuse certain),
then D reads them. D must not report that receive as good: "done" answers that the lease
ended, the receive fails, and under kv_load_failure_policy=recompute D computes the prompt
itself, token-identical.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import metric_total, read_metrics

from .deployments import AUTH_TOKEN, HEARTBEAT_S, LEASE_S, connector_config
from .fault_harness import (
    FaultReport,
    Servers,
    hixl_counter,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    wait_idle,
)

STALE_DELAY_S = LEASE_S + 2.5
# P: 24 blocks of 32 tokens, so three 480-token fillers must reuse every freed block.
P_ARGS = ("--kv-cache-memory-bytes", str(24 * 32 * 1024), "--max-model-len", "512")
FILLER_TOKENS = 480


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path) -> Iterator[Servers]:
    common: dict[str, Any] = {
        "lease_s": LEASE_S,
        "heartbeat_s": HEARTBEAT_S,
        "auth_token": AUTH_TOKEN,
    }
    configs = {
        "prefill": connector_config("prefill", transport="auto", **common),
        "decode": connector_config(
            "decode",
            "recompute",
            transport="auto",
            test_pull_delay_s=STALE_DELAY_S,
            **{**common, "lease_s": 1000.0, "heartbeat_s": 900.0},
        ),
        "decode_other": connector_config("decode", "fail", transport="auto", **common),
    }
    servers = Servers(
        model_dir,
        log_dir / "stale",
        configs,
        extra_args={
            "prefill": P_ARGS,
            "decode_other": ("--dtype", "bfloat16", "--block-size", "64"),
        },
    )
    try:
        servers.start("prefill", "decode", "decode_other")
        yield servers
    finally:
        servers.stop_all()


def prefix_hits(server_url: str) -> float:
    return metric_total(read_metrics(server_url), "vllm:prefix_cache_hits_total")


def test_pull_racing_lease_expiry_and_block_reuse_is_never_decoded(
    pd: Servers, fault_report: FaultReport
) -> None:
    prefill, decode = pd["prefill"], pd["decode"]
    prompt = token_prompt(150, seed=11)
    expected = plain(prefill, prompt)
    stale, expired = hixl_counter(decode, "stale_pulls"), hixl_counter(prefill, "expired_leases")
    params = prefill_leg(prefill, prompt)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(run_decode, decode, prompt, params, 120.0)
        wait_idle(prefill, LEASE_S + 5)  # the lease expired while D waits to read
        for i in range(3):  # other requests take every free block, P's old ones included
            plain(prefill, token_prompt(FILLER_TOKENS, seed=100 + i), max_tokens=1)
        result = future.result(timeout=120)
    assert result.error is None, result.error
    assert result.tokens == expected, "D decoded on KV read from reused blocks"
    assert hixl_counter(decode, "stale_pulls") == stale + 1
    assert hixl_counter(prefill, "expired_leases") == expired + 1
    # P's prefix cache lost the prompt: its blocks really were handed to other requests.
    hits = prefix_hits(prefill.url)
    plain(prefill, prompt, max_tokens=1)
    assert prefix_hits(prefill.url) == hits, "P's old blocks were not reused"
    wait_idle(prefill, 10)
    wait_idle(decode, 10)
    fault_report.record(
        "pull raced with lease expiry and block reuse on P",
        "D's second read of P's lease word finds it cleared; D fails the receive (stale_pulls) and "
        "recomputes (policy recompute): token-identical, never decoded on reused blocks",
        result.finished_at - started - STALE_DELAY_S,
        leftover(prefill, decode),
    )


def test_incompatible_peer_is_refused_clearly(pd: Servers, fault_report: FaultReport) -> None:
    prefill, other = pd["prefill"], pd["decode_other"]
    prompt = token_prompt(100, seed=12)
    failed = hixl_counter(other, "failed_handshakes")
    params = prefill_leg(prefill, prompt)
    started = time.monotonic()
    result = run_decode(other, prompt, params, 30.0)
    detected = result.finished_at - started
    # Its 64-token blocks could be assembled from P's 32-token ones; its dtype cannot.
    assert result.failed, "a bf16 decode engine must not read fp32 KV"
    assert hixl_counter(other, "failed_handshakes") == failed + 1
    log = other.log_tail(200)
    assert "incompatible" in log
    assert "dtype: local='bfloat16' remote='float32'" in log
    wait_idle(prefill, LEASE_S + 5)
    wait_idle(other, 10)
    fault_report.record(
        "incompatible peer (other dtype, larger blocks)",
        "the handshake names the mismatching fields and refuses; the request fails "
        "(policy fail) and D tells P to release",
        detected,
        leftover(prefill, other),
    )
