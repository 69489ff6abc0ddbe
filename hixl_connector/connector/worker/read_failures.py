"""How a read on D can fail, and the one counter each failure is told under.

Every failure counts once: where the reason was found and recorded on the spot (P refused
the lease word, the lease ended during the read, a synchronous read found its P gone), nothing
more is counted; otherwise the failure's kind names the counter.
"""

from __future__ import annotations

from hixl_connector.connector.mapping.read_plans import UnreadableRequest
from hixl_connector.connector.mapping.tp_mapping import TPMismatch
from hixl_connector.connector.metadata import RecvSpec


class LeaseError(RuntimeError):
    """P did not (or could no longer) vouch for the blocks of a pull."""


class PullCancelled(RuntimeError):
    """The request was aborted before its read ended."""


class HandshakeFailed(RuntimeError):
    """A P rank the read needs could not be handshaken or linked; the other ranks' links,
    already made, are good."""


class PeerGone(RuntimeError):
    """A synchronous read found no same-host link to a P rank it reads: P was replaced or is
    gone since a worker reported the link (nothing transient is ever read in the step)."""


def counter_for(spec: RecvSpec, error: Exception) -> str | None:
    """The counter a failed read is told under; None when its reason was counted where it
    was found (``refused_pulls``, ``stale_pulls``, ``sync_load_peer_gone``)."""
    if isinstance(error, PullCancelled):
        return "cancelled_pulls"
    if spec.error or isinstance(error, (TPMismatch, UnreadableRequest)):
        return "invalid_requests"  # refused before anything was read
    if isinstance(error, HandshakeFailed):
        return "failed_handshakes"
    if isinstance(error, (LeaseError, PeerGone)):
        return None
    return "failed_pulls"
