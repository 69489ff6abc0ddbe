"""D side of push mode: which prefill engine serves the address the router named.

The router names P by the identity of P's last push answer, which it keeps until P's next
one, so after a restart it can name an engine that is gone. D learns P's engine id, cluster
id and start from a first-contact handshake (naming no incarnation) and keeps them per
address until a push with that P fails.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from hixl_connector.connector.metadata import RemoteEndpoint
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION, HandshakePayload
from hixl_connector.connector.peers.registry import PeerRegistry

logger = logging.getLogger(__name__)


class PushRefused(RuntimeError):
    """This deployment cannot take the request's KV by push."""


class PrefillEndpoints:
    """P engines by (engine id, host, port) as first contact found them."""

    def __init__(self, peers: PeerRegistry) -> None:
        self._peers = peers
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str, int], RemoteEndpoint] = {}

    def get(self, remote: RemoteEndpoint, fresh: bool) -> tuple[RemoteEndpoint, bool]:
        """P's engine as this rank knows it, and whether it was learned now: by a first
        contact where none is known for this address yet, or ``fresh``."""
        key = _key(remote)
        with self._lock:
            endpoint = None if fresh else self._known.get(key)
        if endpoint is not None:
            return endpoint, False
        endpoint = self._first_contact(remote)
        with self._lock:
            self._known[key] = endpoint
        return endpoint, True

    def forget(self, remote: RemoteEndpoint) -> None:
        """A failure with this P: the next request learns its start again (P restarted?)."""
        with self._lock:
            self._known.pop(_key(remote), None)

    def _first_contact(self, remote: RemoteEndpoint) -> RemoteEndpoint:
        """Whoever serves P's side channel now, by a handshake naming no incarnation. The
        router's picture of P may be older than P's start, but the router sent P's leg to
        that same address, so the engine there is the one prefilling the request."""
        client = self._peers.client_for(remote.rank(0))
        try:
            reply = client.request({"type": "handshake", "schema": SCHEMA_VERSION})
        finally:
            client.close()
        payload = HandshakePayload.from_dict(reply.get("payload"))
        if payload.tp_rank != 0:
            raise PushRefused(
                f"{remote.host}:{remote.port} serves rank {payload.tp_rank} of engine "
                f"{payload.engine_id}, not rank 0"
            )
        if payload.engine_id != remote.engine_id:
            logger.info(
                "hixl: %s:%d now serves prefill engine %s (the router named %s)",
                remote.host,
                remote.port,
                payload.engine_id,
                remote.engine_id,
            )
        return replace(
            remote,
            engine_id=payload.engine_id,
            cluster_id=payload.cluster_id,
            incarnation=payload.incarnation,
        )


def _key(remote: RemoteEndpoint) -> tuple[str, str, int]:
    return (remote.engine_id, remote.host, remote.port)
