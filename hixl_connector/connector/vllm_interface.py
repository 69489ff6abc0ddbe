"""What differs between the vLLM versions the connector supports, in one place.

Supported: vLLM 0.23.0 up to 0.34.x (vllm-ascend 0.23 runs on vLLM 0.23.0). Inside that range
the connector interface differs in these ways that matter here, found by feature, not version:

- **How a failed asynchronous receive is reported.** Newer vLLM asks for
  ``get_transfer_results`` and takes failed receives by request id
  (``KVConnectorTransferResults.failed_recving``). Older vLLM asks for ``get_finished`` only:
  a failed receive is reported as finished, and its blocks as load errors in the same step
  (``get_block_ids_with_load_errors``), from which the scheduler finds the request. Those
  schedulers map block ids to requests in the first KV-cache group only, so there a model
  with several KV-cache groups (the hybrid manager) would crash the scheduler at the first
  failed read: it is refused at start.
- **``CacheHitSource``** (vLLM's metrics of where a prefix hit came from) is newer than 0.27.
- **``KVCacheAccess``** (0.34: whether a connector registers the KV cache for remote access,
  which decides how vLLM allocates it) is asked only where it exists.

From 0.33 on, vLLM asks connectors more. The connector refuses sleep mode (``facade``); the
base class's defaults are its answers to the rest: no lookahead block hashes, a request with
``do_remote_prefill`` loads asynchronously, P's hand-offs must be delivered. Its hooks hold in
the orders 0.33 and 0.34 call them in (``tests/unit/test_hook_orders.py``).

Outside the range the connector refuses to start, naming it: the interface is not stable
across vLLM minor versions, and a hook renamed or dropped would otherwise fail silently.
"""

from __future__ import annotations

import re
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base

from hixl_connector.connector.mapping.state_groups import is_state_spec

OLDEST = (0, 23)
NEWEST = (0, 34)
SUPPORTED_RANGE = f"{OLDEST[0]}.{OLDEST[1]}.0 to {NEWEST[0]}.{NEWEST[1]}.x"

# Newer vLLM: failed receives by request id through get_transfer_results.
REPORTS_FAILED_RECEIVES = hasattr(base, "KVConnectorTransferResults")


class UnsupportedVllm(RuntimeError):
    """This vLLM (or this model on it) is outside what the connector supports."""


def minor_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as "0.32.0+cpu" or "0.27.1"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVllm(f"cannot read the vLLM version {version!r}")
    return int(match[1]), int(match[2])


def check_supported(
    version: str, kv_cache_groups: int, reports_failed_receives: bool, state: bool = False
) -> None:
    """Refuses, naming what to change, a vLLM or a model shape the connector cannot serve
    safely on it (``state``: a hybrid state model's, whose state groups vLLM keeps only
    under the hybrid KV-cache manager)."""
    if not OLDEST <= minor_version(version) <= NEWEST:
        raise UnsupportedVllm(
            f"hixl_connector supports vLLM {SUPPORTED_RANGE}; this is vLLM {version}"
        )
    if state and not reports_failed_receives:
        raise UnsupportedVllm(
            f"vLLM {version} reports a failed KV read by block id, which its scheduler maps "
            "in the first KV-cache group only, and a hybrid state model (Mamba2, Gated "
            "DeltaNet, short convolutions) has several: serve it disaggregated on a vLLM that "
            "has KVConnectorTransferResults (such as 0.32)"
        )
    if kv_cache_groups > 1 and not reports_failed_receives:
        raise UnsupportedVllm(
            f"vLLM {version} reports a failed KV read by block id, which its scheduler maps "
            f"in the first of a model's KV-cache groups only; this model has "
            f"{kv_cache_groups} (hybrid KV-cache manager). Start vLLM with "
            "--disable-hybrid-kv-cache-manager, or use a vLLM that has "
            "KVConnectorTransferResults (such as 0.32)"
        )


def check_this_vllm(kv_cache_config: Any) -> None:
    """check_supported for the running vLLM and the KV-cache config it gave the connector."""
    import vllm

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    state = any(is_state_spec(group.kv_cache_spec) for group in groups)
    check_supported(str(vllm.__version__), len(groups), REPORTS_FAILED_RECEIVES, state)


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """KVConnectorTransferResults of newer vLLM (only called there)."""
    return base.KVConnectorTransferResults(
        finished_sending=sending, finished_recving=recving, failed_recving=failed
    )


def p2p_cache_hit_source() -> Any:
    """CacheHitSource.P2P where vLLM has it, else None (older vLLM never reads it)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.P2P


def registers_kv_cache() -> Any:
    """KVCacheAccess.REGISTERS where vLLM has it (0.34: how its extensible KV cache
    allocates), else None (older vLLM never asks)."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    return KVCacheAccess.REGISTERS
