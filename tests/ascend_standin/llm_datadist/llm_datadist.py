"""CANN's ``LLMDataDist`` as its Python layer behaves, with the project's C++ engine
(``hixl_connector._native``) where CANN has its compiled layer."""

from __future__ import annotations

import logging
import os
from typing import Any

from hixl_connector import _native

from . import fabric
from .cache_manager import CacheManager, int64, not_emulated
from .llm_types import LLMClusterInfo, LLMRole, RegisterMemStatus, ip_text
from .recorder import record
from .status import (
    LLMStatusCode,
    check_isinstance,
    check_uint,
    raise_if_false,
    raise_if_true,
    status_of,
)

# Native transport under the stand-in ("tcp" lets a stopped peer time a pull out).
TRANSPORT_ENV = "HIXL_STANDIN_TRANSPORT"
MAX_CLUSTERS_PER_CALL = 16
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
_initialized: list[LLMDataDist] = []  # CANN allows one LLMDataDist per process
logger = logging.getLogger(__name__)


def check_listen_ip_info(value: str) -> tuple[str, int]:
    """CANN splits "ip:port" on every colon, so an IPv6 address fails ``init``; the address
    itself is not checked in Python."""
    parts = value.split(":")
    raise_if_false(
        len(parts) == 2, f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"'
    )
    return parts[0], int(parts[1])  # CANN: int(port), so a non-number raises ValueError


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        record("LLMDataDist")
        check_isinstance("role", role, LLMRole)
        check_uint("cluster_id", cluster_id, 64)
        self._role = role
        self._cluster_id = cluster_id
        self._engine: Any = None
        self._cache_manager: CacheManager | None = None
        self._v1 = False  # initialised without the cache manager: CANN's v1 API

    def init(self, options: dict[str, str]) -> None:
        """CANN's option rules (its ``_setup_engine_option``): ``llm.LocalCommRes`` turns the
        cache manager and remote access on unless set; ``llm.TransferBackend`` needs the
        cache manager, remote access (on unless set) and ``llm.listenIpInfo``. Without the
        cache manager CANN starts its v1 API, which has no ``cache_manager``. Every option key
        is forwarded, as CANN forwards it; those the engine has no use for are ignored."""
        record("init")
        if self._cache_manager is not None or self._v1:
            return
        raise_if_false(
            not _initialized,
            "Cannot init multiple LLMDataDists",
            status_code=LLMStatusCode.LLM_FAILED,
        )
        check_isinstance("options", options, dict)
        options = dict(options)
        if "llm.LocalCommRes" in options:
            options.setdefault("llm.EnableCacheManager", "1")
            options.setdefault("llm.EnableRemoteCacheAccessible", "1")
        cache_manager = options.get("llm.EnableCacheManager") == "1"
        if "llm.LocalCommRes" in options:
            raise_if_false(
                cache_manager,
                "llm.LocalCommRes is not supported when llm.EnableCacheManager is not configured.",
            )
        if "llm.TransferBackend" in options:
            raise_if_false(
                cache_manager,
                "llm.TransferBackend is not supported when llm.EnableCacheManager is not "
                "configured.",
            )
            options.setdefault("llm.EnableRemoteCacheAccessible", "1")
            raise_if_false(
                options["llm.EnableRemoteCacheAccessible"] == "1",
                "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible is "
                "not enable.",
            )
            raise_if_false(
                "llm.listenIpInfo" in options,
                "llm.TransferBackend is not supported when llm.listenIpInfo is not configured.",
            )
        raise_if_false("ge.exec.deviceId" in options, "ge.exec.deviceId is required")
        if not cache_manager:
            self._v1 = True  # nothing of v1 is emulated beyond this
            _initialized.append(self)
            return
        host, port = "", -1
        if "llm.listenIpInfo" in options:
            host, port = check_listen_ip_info(options["llm.listenIpInfo"])
        accessible = options.get("llm.EnableRemoteCacheAccessible") == "1"
        timeout_ms = int(options.get("llm.SyncKvCacheWaitTime", DEFAULT_SYNC_KV_TIMEOUT_MS))
        transport = os.environ.get(TRANSPORT_ENV, "auto")
        self._engine = _native.Engine(int64(self._cluster_id), host, port, "", transport)
        self._cache_manager = CacheManager(
            self._engine,
            accessible,
            timeout_ms,
            fabric.mode(),
            fabric.pool_bytes(options),
            fabric.Table(int64(self._cluster_id)),
        )
        _initialized.append(self)

    @property
    def fabric(self) -> str:
        """The link mode this engine runs under (stand-in only; CANN picks HCCS or RoCE)."""
        return self.cache_manager.link_mode

    @property
    def cache_manager(self) -> CacheManager:
        raise_if_true(
            self._v1,
            "cache_manager is not supported when llm.EnableCacheManager is not configured.",
        )
        if self._cache_manager is None:
            raise RuntimeError("llm datadist is not initialized")
        return self._cache_manager

    def link_clusters(
        self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        record("link_clusters")

        def link(cluster: LLMClusterInfo) -> int:
            if not cluster.remote_ip_info_list:
                return int(LLMStatusCode.LLM_PARAM_INVALID)
            ip, port = cluster.remote_ip_info_list[0]
            remote = int64(cluster.remote_cluster_id or 0)
            manager = self.cache_manager
            peer = fabric.peer_table(remote) or {}
            refusal = fabric.link_refusal(
                manager.link_mode, manager.table.memories() + list(peer.values())
            )
            if refusal is not None:
                logger.error("stand-in: link to cluster %d fails: %s", remote, refusal)
                return int(LLMStatusCode.LLM_LINK_FAILED)
            code = int(self._engine.link(remote, ip_text(ip), port, timeout)[0])
            if code == LLMStatusCode.LLM_SUCCESS:
                manager.peers[remote] = peer
            return code

        status, per_cluster = self._each(clusters, timeout, link)
        if any(code == LLMStatusCode.LLM_SUCCESS for code in per_cluster):
            self.cache_manager.linked = True
        return status, per_cluster

    def unlink_clusters(
        self,
        clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
        timeout: int = 3000,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        record("unlink_clusters(force)" if force else "unlink_clusters")
        check_isinstance("force", force, bool)

        def unlink(cluster: LLMClusterInfo) -> int:
            remote = int64(cluster.remote_cluster_id or 0)
            return int(self._engine.unlink(remote, timeout, bool(force))[0])

        return self._each(clusters, timeout, unlink)

    def _each(
        self, clusters: Any, timeout: Any, action: Any
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        raise_if_false(self._engine is not None, "llm datadist is not initialized")
        check_isinstance("clusters", clusters, (list, tuple), LLMClusterInfo)
        check_uint("timeout", timeout, 31)
        raise_if_false(timeout > 0, "Param timeout should be greater than 0.")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        per_cluster = [status_of(action(cluster)) for cluster in clusters]
        failed = [code for code in per_cluster if code != LLMStatusCode.LLM_SUCCESS]
        return (failed[-1] if failed else LLMStatusCode.LLM_SUCCESS), per_cluster

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        raise not_emulated("switch_role")

    def link(self, *args: Any) -> int:
        raise not_emulated("link (ranktable mode)")

    def unlink(self, *args: Any) -> None:
        raise not_emulated("unlink (ranktable mode)")

    def query_register_mem_status(self, *args: Any) -> RegisterMemStatus:
        raise not_emulated("query_register_mem_status")

    def finalize(self) -> None:
        record("finalize")
        if self._cache_manager is not None:
            self._cache_manager.table.remove()
        if self._engine is not None:
            self._engine.close()
        if self in _initialized:
            _initialized.remove(self)
        self._engine = None
        self._cache_manager = None
        self._v1 = False
