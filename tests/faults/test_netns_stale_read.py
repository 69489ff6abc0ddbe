"""A read that races with block reuse is never decoded: proven on the production path.

P and D in their own network namespaces over TCP, the production connector on both sides (no
test control: D's guarded read is the one engine batch it always is: lease word, blocks, word
again). Only the link is slowed: P sends at 96 kbit/s,
so reading a 150-token prompt's blocks takes over ten seconds. D renews no lease (its
heartbeat period is far longer than P's lease): P's lease expires during the read, P clears
the word and hands the blocks to other requests (a tiny KV cache makes reuse certain), while
D's engine is still reading them. D's second read of the word must find it cleared: the
receive fails as stale and, under kv_load_failure_policy=recompute, D computes the prompt
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
from hixl_connector.tools.netns import NetnsBed

from .deployments import AUTH_TOKEN, HEARTBEAT_S, LEASE_S, connector_config
from .fault_harness import (
    FaultReport,
    Servers,
    hixl_counter,
    in_namespaces,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    wait_idle,
)

# P: 24 blocks of 32 tokens, so three 480-token fillers must reuse every freed block.
P_ARGS = ("--kv-cache-memory-bytes", str(24 * 32 * 1024), "--max-model-len", "512")
FILLER_TOKENS = 480
LINK_RATE = "96kbit"  # 5 blocks of 32 KiB: about 14 s on the link
READ_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[Servers]:
    common: dict[str, Any] = {"transport": "tcp", "auth_token": AUTH_TOKEN}
    configs = {
        "prefill": connector_config("prefill", lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S, **common),
        "decode": connector_config(
            "decode",
            "recompute",
            lease_s=1000.0,
            heartbeat_s=900.0,
            pull_timeout_s=READ_TIMEOUT_S,
            **common,
        ),
    }
    with in_namespaces(
        model_dir, log_dir / "netns_stale", configs, net, extra_args={"prefill": P_ARGS}
    ) as servers:
        servers.start("prefill", "decode")
        yield servers


def prefix_hits(server_url: str) -> float:
    return metric_total(read_metrics(server_url), "vllm:prefix_cache_hits_total")


def test_a_read_racing_block_reuse_is_refused_by_its_own_batch(
    pd: Servers, net: NetnsBed, fault_report: FaultReport
) -> None:
    prefill, decode = pd["prefill"], pd["decode"]
    prompt = token_prompt(150, seed=13)
    expected = plain(prefill, prompt)
    stale, expired = hixl_counter(decode, "stale_pulls"), hixl_counter(prefill, "expired_leases")
    params = prefill_leg(prefill, prompt)
    net.throttle(LINK_RATE)
    try:
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            future = pool.submit(run_decode, decode, prompt, params, READ_TIMEOUT_S + 30)
            wait_idle(prefill, LEASE_S + 5)  # the lease expired while D's read goes on
            for i in range(3):  # other requests take every free block, P's old ones included
                plain(prefill, token_prompt(FILLER_TOKENS, seed=200 + i), max_tokens=1)
            result = future.result(timeout=READ_TIMEOUT_S + 30)
    finally:
        net.restore()
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
        "netns + TCP: a read of P's blocks raced with lease expiry and block reuse "
        "(production batch, link at 96 kbit/s)",
        "D's one batch read the word, the blocks while P reused them, and the word again, "
        "cleared: the receive failed as stale (stale_pulls) and D recomputed (policy "
        "recompute): token-identical, never decoded on reused blocks",
        result.finished_at - started,
        leftover(prefill, decode),
    )
