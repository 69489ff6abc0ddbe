"""An incompatible decode engine is refused clearly, before it reads a byte: real vLLM
servers, P in fp32 with 32-token blocks, D in bf16 with 64-token blocks.

(A read that races with block reuse is proven never decoded in test_netns_stale_read.py, on
the production path.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .deployments import AUTH_TOKEN, HEARTBEAT_S, LEASE_S, connector_config
from .fault_harness import (
    FaultReport,
    Servers,
    hixl_counter,
    leftover,
    prefill_leg,
    run_decode,
    token_prompt,
    wait_idle,
)


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path) -> Iterator[Servers]:
    common: dict[str, Any] = {
        "lease_s": LEASE_S,
        "heartbeat_s": HEARTBEAT_S,
        "auth_token": AUTH_TOKEN,
    }
    configs = {
        "prefill": connector_config("prefill", transport="auto", **common),
        "decode_other": connector_config("decode", "fail", transport="auto", **common),
    }
    with Servers(
        model_dir,
        log_dir / "incompatible",
        configs,
        extra_args={"decode_other": ("--dtype", "bfloat16", "--block-size", "64")},
    ) as servers:
        servers.start("prefill", "decode_other")
        yield servers


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
