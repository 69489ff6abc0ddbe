"""Each failed read is counted once, under its own reason."""

from __future__ import annotations

import pytest

from hixl_connector.connector.endpoints import UNKNOWN_ENDPOINT
from hixl_connector.connector.mapping.read_plans import UnreadableRequest
from hixl_connector.connector.mapping.tp_mapping import TPMismatch
from hixl_connector.connector.metadata import RecvSpec
from hixl_connector.connector.worker.read_failures import (
    HandshakeFailed,
    LeaseError,
    PeerGone,
    PullCancelled,
    counter_for,
)


def spec(error: str = "") -> RecvSpec:
    return RecvSpec("r", "p-r", 1, UNKNOWN_ENDPOINT, (1,), (2,), error=error)


@pytest.mark.parametrize(
    ("error", "params_error", "counter"),
    [
        (PullCancelled("aborted"), "", "cancelled_pulls"),
        (LeaseError("params refused"), "unusable params", "invalid_requests"),
        (TPMismatch("3 heads over 2 ranks"), "", "invalid_requests"),
        (UnreadableRequest("block sizes"), "", "invalid_requests"),
        (HandshakeFailed("rank 1 refused"), "", "failed_handshakes"),
        # Counted where they were found: refused_pulls / stale_pulls, sync_load_peer_gone.
        (LeaseError("not vouched for"), "", None),
        (PeerGone("no same-host link"), "", None),
        (TimeoutError("pull timed out"), "", "failed_pulls"),
        (RuntimeError("link broken"), "", "failed_pulls"),
    ],
)
def test_a_failure_is_counted_once_under_its_reason(
    error: Exception, params_error: str, counter: str | None
) -> None:
    assert counter_for(spec(params_error), error) == counter
