"""D side: the engine calls behind a peer's link: `link_clusters` and `unlink_clusters` of
one prefill rank, by what its handshake announced."""

from __future__ import annotations

import logging
from typing import Any

from hixl_connector.connector.peers.compatibility import PeerError
from hixl_connector.connector.peers.handshake import HandshakePayload
from hixl_connector.datadist import Backend, DataDist

logger = logging.getLogger(__name__)

# An unlink waits this long for the peer's goodbye (a dead peer never answers).
UNLINK_TIMEOUT_MS = 1000


class EngineLinks:
    def __init__(
        self, api: Backend, datadist: DataDist, engine_host: str, timeout_s: float
    ) -> None:
        """``engine_host``: this engine's address; ``timeout_s``: the bound of a link."""
        self._api = api
        self._datadist = datadist
        self._engine_host = engine_host
        self._timeout_ms = int(timeout_s * 1000)

    def link(self, payload: HandshakePayload) -> None:
        """Links the prefill rank ``payload`` announced; raises PeerError."""
        info = self._cluster_info(payload)
        status, per_cluster = self._datadist.link_clusters([info], self._timeout_ms)
        codes = self._api.LLMStatusCode
        result = per_cluster[0] if per_cluster else status
        # ALREADY_LINK is a failure too: stale links are torn down before linking, so another
        # engine holds this cluster id.
        if status != codes.LLM_SUCCESS or result != codes.LLM_SUCCESS:
            raise PeerError(
                f"link_clusters to cluster {payload.cluster_id} at "
                f"{payload.engine_host}:{payload.engine_port} failed: {status!r} {per_cluster!r}"
            )

    def unlink(self, payload: HandshakePayload, force: bool) -> None:
        """Unlinks it; never raises (the link is gone locally either way)."""
        info = self._cluster_info(payload)
        try:
            self._datadist.unlink_clusters([info], UNLINK_TIMEOUT_MS, force=force)
        except Exception as e:  # unlinking a dead peer may fail; the link is gone either way
            logger.warning("hixl: unlink of cluster %d failed: %s", payload.cluster_id, e)

    def _cluster_info(self, payload: HandshakePayload) -> Any:
        info = self._api.LLMClusterInfo()
        info.remote_cluster_id = payload.cluster_id
        # Port 0: the local side of a one-sided link needs no listener.
        info.append_local_ip_info(self._engine_host, 0)
        info.append_remote_ip_info(payload.engine_host, payload.engine_port)
        return info
