"""Connector configurations of the fault deployments: short leases and timeouts, so that
every expiry and timeout in the matrix happens within seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hixl_test_connector import with_controls

from hixl_connector.tools.demo.processes import free_port

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
AUTH_TOKEN = "fault-matrix-token-0123456789abcdef0123"
LEASE_S = 3.0
HEARTBEAT_S = 0.5
PULL_TIMEOUT_S = 3.0
# How long D waits for a push's word (push_timeout_s), set apart from a read's bound.
PUSH_TIMEOUT_S = 3.0
HANDSHAKE_TIMEOUT_S = 2.0
# How long P and D may take to hold no block and no request again after a fault: a lease's
# expiry, the latest moment P frees blocks no one released, with room for a loaded host.
IDLE_TIMEOUT_S = LEASE_S + 10.0


def connector_config(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    """``configs/<role>.json`` with a free side-channel port and ``extra`` keys."""
    config = json.loads((CONFIG_DIR / f"{role}.json").read_text())
    merged = dict(config.get("kv_connector_extra_config", {}))
    merged["side_channel_port"] = free_port()
    merged.update(extra)
    config["kv_connector_extra_config"] = merged
    if role == "decode":
        config["kv_load_failure_policy"] = policy
    return with_controls(config)


def short_lease_pair(
    transport: str = "tcp", policy: str = "fail", **decode: Any
) -> dict[str, dict[str, Any]]:
    """P and D with seconds-long leases and timeouts, both requiring the auth token."""
    common: dict[str, Any] = {
        "transport": transport,
        "lease_s": LEASE_S,
        "heartbeat_s": HEARTBEAT_S,
        "pull_timeout_s": PULL_TIMEOUT_S,
        "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
        "auth_token": AUTH_TOKEN,
    }
    return {
        "prefill": connector_config("prefill", **common),
        "decode": connector_config("decode", policy, **common, **decode),
    }
