"""D side: the engine calls behind a peer's link: `link_clusters` and `unlink_clusters` of
one prefill rank, by what its handshake announced."""

from __future__ import annotations

import logging
import time
from typing import Any

from hixl_connector.connector.peers.compatibility import PeerError
from hixl_connector.connector.peers.handshake import HandshakePayload
from hixl_connector.datadist import Backend, DataDist

logger = logging.getLogger(__name__)

# An unlink waits this long for the peer's goodbye (a dead peer never answers).
UNLINK_TIMEOUT_MS = 1000
# A prefill engine at its connection cap answers busy: the link waits its turn, trying
# again after these pauses (doubling), within the link's own bound.
BUSY_FIRST_PAUSE_S = 0.02
BUSY_MAX_PAUSE_S = 0.25


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
        self.link_to(payload.cluster_id, payload.engine_host, payload.engine_port)

    def link_to(self, cluster_id: int, host: str, port: int) -> None:
        """Links the engine of ``cluster_id`` listening at ``host:port``; raises PeerError. A
        busy engine (at its connection cap) is asked again until the link's bound passes."""
        info = self._cluster_info(cluster_id, host, port)
        codes = self._api.LLMStatusCode
        deadline = time.monotonic() + self._timeout_ms / 1000
        pause = BUSY_FIRST_PAUSE_S
        while True:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            status, per_cluster = self._datadist.link_clusters([info], left_ms)
            result = per_cluster[0] if per_cluster else status
            # ALREADY_LINK is a failure too: stale links are torn down before linking, so
            # another engine holds this cluster id.
            if status == codes.LLM_SUCCESS and result == codes.LLM_SUCCESS:
                return
            busy = codes.LLM_LINK_BUSY in (status, result)
            if not busy or time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, BUSY_MAX_PAUSE_S)
        why = (
            f"busy for {self._timeout_ms} ms: the prefill engine is at its connection cap "
            "(its kv_connector_extra_config 'server_connections' raises it)"
            if busy
            else f"failed: {status!r} {per_cluster!r}"
        )
        raise PeerError(f"link_clusters to cluster {cluster_id} at {host}:{port} {why}")

    def unlink(self, payload: HandshakePayload, force: bool) -> None:
        """Unlinks it; never raises (the link is gone locally either way)."""
        info = self._cluster_info(payload.cluster_id, payload.engine_host, payload.engine_port)
        try:
            self._datadist.unlink_clusters([info], UNLINK_TIMEOUT_MS, force=force)
        except Exception as e:  # unlinking a dead peer may fail; the link is gone either way
            logger.warning("hixl: unlink of cluster %d failed: %s", payload.cluster_id, e)

    def _cluster_info(self, cluster_id: int, host: str, port: int) -> Any:
        info = self._api.LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        # Port 0: the local side of a one-sided link needs no listener.
        info.append_local_ip_info(self._engine_host, 0)
        info.append_remote_ip_info(host, port)
        return info
