"""CANN's ``LLMDataDist`` as its Python layer behaves, over the project's native engine."""

from __future__ import annotations

import os
from typing import Any

from hixl_connector.datadist import LLMClusterInfo, LLMRole, LLMStatusCode, RegisterMemStatus
from hixl_connector.datadist import LLMDataDist as _NativeLLMDataDist
from hixl_connector.datadist.checks import check_isinstance
from hixl_connector.datadist.status import raise_if_false

from .cache_manager import CacheManager, _not_emulated
from .recorder import record

# Native transport under the stand-in ("tcp" lets a stopped peer time a pull out).
TRANSPORT_ENV = "HIXL_STANDIN_TRANSPORT"


def check_listen_ip_info(value: str) -> None:
    """CANN splits "ip:port" on every colon, so an IPv6 address fails ``init``; the address
    itself is not checked in Python."""
    parts = value.split(":")
    raise_if_false(
        len(parts) == 2, f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"'
    )
    int(parts[1])  # CANN: int(port), so a non-number raises ValueError


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        record("LLMDataDist")
        self._native = _NativeLLMDataDist(role, cluster_id)
        self._cache_manager: CacheManager | None = None

    def init(self, options: dict[str, str]) -> None:
        """Every option key is forwarded, as CANN forwards it; the engine ignores those it
        does not know."""
        record("init")
        if self._cache_manager is not None:
            return
        check_isinstance("options", options, dict)
        if "llm.listenIpInfo" in options:
            check_listen_ip_info(options["llm.listenIpInfo"])
        native_options = dict(options)
        native_options["hixl.transport"] = os.environ.get(TRANSPORT_ENV, "auto")
        self._native.init(native_options)  # a second instance raises LLM_FAILED here
        accessible = native_options.get("llm.EnableRemoteCacheAccessible") == "1" or bool(
            native_options.get("llm.LocalCommRes") or native_options.get("llm.TransferBackend")
        )
        self._cache_manager = CacheManager(self._native.cache_manager, accessible)

    @property
    def cache_manager(self) -> CacheManager:
        if self._cache_manager is None:
            raise RuntimeError("llm datadist is not initialized")
        return self._cache_manager

    def link_clusters(
        self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        record("link_clusters")
        status, per_cluster = self._native.link_clusters(clusters, timeout)
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
        return self._native.unlink_clusters(clusters, timeout, force)

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        raise _not_emulated("switch_role")

    def link(self, *args: Any) -> int:
        raise _not_emulated("link (ranktable mode)")

    def unlink(self, *args: Any) -> None:
        raise _not_emulated("unlink (ranktable mode)")

    def query_register_mem_status(self, *args: Any) -> RegisterMemStatus:
        raise _not_emulated("query_register_mem_status")

    def finalize(self) -> None:
        record("finalize")
        self._native.finalize()
        self._cache_manager = None
