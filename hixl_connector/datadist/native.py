"""LLMDataDist of the LLM-DataDist v2 API on the project's native engine.

The engine module ``hixl_connector._native`` is imported on ``init``, not at import time.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, ClassVar

from hixl_connector.datadist.cache_manager import CacheManager
from hixl_connector.datadist.checks import check_int32, check_isinstance, check_uint64, to_int64
from hixl_connector.datadist.config import (
    DEFAULT_SERVER_CONNECTIONS,
    DEFAULT_SERVER_HANDSHAKES,
    MAX_SERVER_CONNECTIONS,
    MAX_SERVER_THREADS,
    MAX_TCP_CONNECTIONS,
    MAX_TRANSFER_THREADS,
    OPT_AUTH_TOKEN,
    OPT_SERVER_CONNECTIONS,
    OPT_SERVER_HANDSHAKES,
    OPT_SERVER_THREADS,
    OPT_TCP_CONNECTIONS,
    OPT_TRANSFER_THREADS,
    OPT_TRANSPORT,
    TRANSPORTS,
    LLMClusterInfo,
    LLMRole,
    int_to_ip,
)
from hixl_connector.datadist.status import (
    LLMException,
    LLMStatusCode,
    code_to_status,
    raise_if_false,
)

logger = logging.getLogger(__name__)
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
MAX_CLUSTERS_PER_CALL = 16
AUTH_TOKEN_ENV = "HIXL_AUTH_TOKEN"
# The bindings this module is written against (``ABI_VERSION`` in native/bindings/module.cpp):
# an extension built from other sources would fail later, on some name or argument.
NATIVE_ABI_VERSION = 5


def load_native() -> Any:
    try:
        from hixl_connector import _native
    except ImportError as exc:
        raise ImportError(
            "the native engine hixl_connector._native is not built; install the package with "
            "`pip install --no-build-isolation -e .` (needs a C++17 compiler, CMake and the "
            "OpenSSL headers)"
        ) from exc
    built = getattr(_native, "ABI_VERSION", None)
    if built != NATIVE_ABI_VERSION:
        raise ImportError(
            f"stale build: hixl_connector._native has ABI_VERSION {built!r}, this package "
            f"needs {NATIVE_ABI_VERSION}; rebuild with bash .ci/setup (or "
            "`pip install --no-build-isolation -e .`)"
        )
    return _native


def _int_option(options: dict[str, str], key: str, default: int, low: int, high: int) -> int:
    raw = options.get(key)
    if raw is None:
        return default
    raise_if_false(
        raw.isdigit() and low <= int(raw) <= high,
        f"option {key}={raw!r} must be an integer in [{low}, {high}]",
    )
    return int(raw)


def _parse_listen_ip_info(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    raise_if_false(
        bool(sep) and bool(host) and port.isdigit() and int(port) <= 65535,
        f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"',
    )
    return host, int(port)


def _role_name(role: LLMRole) -> str:
    return {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}[role]


class LLMDataDist:
    """One per process. ``init`` options come from ``LLMConfig.generate_options()``."""

    llm_engine_instance: ClassVar[LLMDataDist | None] = None

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._engine: Any = None
        self._cache_manager: CacheManager | None = None
        self._options: dict[str, str] = {}
        self._is_initialized = False

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    def init(self, options: dict[str, str]) -> None:
        if self._is_initialized:
            return
        raise_if_false(
            LLMDataDist.llm_engine_instance is None,
            "Cannot init multiple LLMDataDists",
            status_code=LLMStatusCode.LLM_FAILED,
        )
        check_isinstance("options", options, dict, allow_none=False)
        opts = self._setup_engine_options(options)
        engine_args = self._engine_args(opts)
        native = load_native()
        try:
            self._engine = native.Engine(to_int64(self._cluster_id), *engine_args)
        except ValueError as exc:
            raise LLMException(
                f"[LLMDataDist.init] invalid option: {exc}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from exc
        except RuntimeError as exc:
            raise LLMException(
                f"[LLMDataDist.init] failed: {exc}", status_code=LLMStatusCode.LLM_FAILED
            ) from exc
        timeout = _int_option(
            opts, "llm.SyncKvCacheWaitTime", DEFAULT_SYNC_KV_TIMEOUT_MS, 1, 2**31 - 1
        )
        self._options = opts
        self._cache_manager = CacheManager(self._engine, opts, timeout)
        LLMDataDist.llm_engine_instance = self
        self._is_initialized = True

    def _setup_engine_options(self, options: dict[str, str]) -> dict[str, str]:
        """Derived options, as CANN derives them (local_comm_res and transfer_backend imply
        cache-manager and remote-accessible mode)."""
        opts = dict(options)
        opts["llm.Role"] = _role_name(self._role)
        if "llm.LocalCommRes" in options:
            opts.setdefault("llm.EnableCacheManager", "1")
            opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
        raise_if_false(
            opts.get("llm.EnableCacheManager") == "1",
            "the native engine implements the v2 cache-manager API only: set "
            "LLMConfig.enable_cache_manager = True",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
        if "llm.TransferBackend" in options:
            raise_if_false(
                options["llm.TransferBackend"] == "hixl",
                f"llm.TransferBackend {options['llm.TransferBackend']!r} is not supported, "
                "use 'hixl'",
            )
            opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
            raise_if_false(
                opts["llm.EnableRemoteCacheAccessible"] == "1",
                "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible "
                "is not enable.",
            )
            raise_if_false(
                "llm.listenIpInfo" in options,
                "llm.TransferBackend is not supported when llm.listenIpInfo is not configured.",
            )
        raise_if_false(
            "ge.exec.deviceId" in opts, "ge.exec.deviceId is required (set LLMConfig.device_id)"
        )
        return opts

    @staticmethod
    def _engine_args(opts: dict[str, str]) -> tuple[str, int, str, str, int, int, int, int, int]:
        host, port = "", -1
        if opts.get("llm.listenIpInfo"):
            host, port = _parse_listen_ip_info(opts["llm.listenIpInfo"])
        token = opts.get(OPT_AUTH_TOKEN, os.environ.get(AUTH_TOKEN_ENV, ""))
        transport = opts.get(OPT_TRANSPORT, "auto")
        raise_if_false(
            transport in TRANSPORTS,
            f"option {OPT_TRANSPORT}={transport!r} must be one of {TRANSPORTS}",
        )
        threads = _int_option(opts, OPT_TRANSFER_THREADS, 2, 1, MAX_TRANSFER_THREADS)
        # One TCP connection per transfer thread by default: a pull's chunks then travel at
        # once instead of queueing on two sockets.
        default = min(threads, MAX_TCP_CONNECTIONS)
        connections = _int_option(opts, OPT_TCP_CONNECTIONS, default, 1, MAX_TCP_CONNECTIONS)
        handshakes = _int_option(
            opts, OPT_SERVER_HANDSHAKES, DEFAULT_SERVER_HANDSHAKES, 1, MAX_SERVER_CONNECTIONS
        )
        served = _int_option(
            opts,
            OPT_SERVER_CONNECTIONS,
            DEFAULT_SERVER_CONNECTIONS,
            1 + MAX_TCP_CONNECTIONS,
            MAX_SERVER_CONNECTIONS,
        )
        loops = _int_option(opts, OPT_SERVER_THREADS, 0, 0, MAX_SERVER_THREADS)
        return host, port, token, transport, connections, threads, handshakes, served, loops

    def _check_is_inited(self) -> None:
        if not self._is_initialized:
            raise RuntimeError("llm datadist is not initialized")

    @property
    def cache_manager(self) -> CacheManager:
        self._check_is_inited()
        assert self._cache_manager is not None
        return self._cache_manager

    @property
    def listen_port(self) -> int:
        """Project extension: the bound listen port (useful with ``ip:0``), -1 without one."""
        self._check_is_inited()
        return int(self._engine.listen_port)

    def engine_stats(self) -> dict[str, int]:
        """Project extension: the native engine's counters (bytes, pulls, links opened ever,
        open_links now, peak_internal_bytes)."""
        self._check_is_inited()
        return dict(self._engine.stats())

    def peer_transport(self, remote_cluster_id: int) -> str:
        """Project extension: "cma" or "tcp" for a linked peer, "" when not linked."""
        self._check_is_inited()
        return str(self._engine.peer_transport(to_int64(remote_cluster_id)))

    # --- links ----------------------------------------------------------------------------
    def _check_link_args(self, clusters: Any, timeout: Any) -> None:
        self._check_is_inited()
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, "Param timeout should be greater than 0.")
        check_isinstance("clusters", clusters, (list, tuple), LLMClusterInfo, allow_none=False)

    def _for_each(
        self, clusters: list[LLMClusterInfo], action: Any
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        if not clusters:
            return LLMStatusCode.LLM_PARAM_INVALID, []
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, []
        if len(clusters) == 1:
            rets = [action(clusters[0])]
        else:
            from concurrent.futures import ThreadPoolExecutor  # only for multi-peer calls

            with ThreadPoolExecutor(max_workers=len(clusters)) as pool:
                rets = list(pool.map(action, clusters))
        overall = LLMStatusCode.LLM_SUCCESS
        for ret in rets:
            overall = ret if ret != LLMStatusCode.LLM_SUCCESS else overall
        return overall, rets

    def link_clusters(
        self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        self._check_link_args(clusters, timeout)
        comm_res = self._options.get("llm.LocalCommRes")
        for cluster in clusters:
            if not comm_res:
                raise_if_false(
                    cluster.local_ip_info_list,
                    "local_ip_info_list is empty. Call append_local_ip_info to add local_ip_info "
                    "when local_comm_res option is unspecified or empty.",
                )
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)

        def link_one(cluster: LLMClusterInfo) -> LLMStatusCode:
            if not cluster.remote_ip_info_list:
                logger.warning("link to cluster %s: no remote ip info", cluster.remote_cluster_id)
                return LLMStatusCode.LLM_PARAM_INVALID
            ip, port = cluster.remote_ip_info_list[0]
            status, message = self._engine.link(
                to_int64(int(cluster.remote_cluster_id or 0)), int_to_ip(ip), port, timeout
            )
            if status != 0:
                logger.warning("link to cluster %s failed: %s", cluster.remote_cluster_id, message)
            return code_to_status(status)

        return self._for_each(list(clusters), link_one)

    def unlink_clusters(
        self,
        clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
        timeout: int = 3000,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        self._check_link_args(clusters, timeout)
        check_isinstance("force", force, bool)
        for cluster in clusters:
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)

        def unlink_one(cluster: LLMClusterInfo) -> LLMStatusCode:
            remote = to_int64(int(cluster.remote_cluster_id or 0))
            status, message = self._engine.unlink(remote, timeout, bool(force))
            if status != 0:
                logger.warning(
                    "unlink of cluster %s failed: %s", cluster.remote_cluster_id, message
                )
            return code_to_status(status)

        return self._for_each(list(clusters), unlink_one)

    def _not_supported(self, what: str) -> LLMException:
        self._check_is_inited()
        return LLMException(
            f"{what} is not supported by the native engine",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        raise self._not_supported("switch_role")

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        raise self._not_supported("link (HCCL ranktable mode; use link_clusters)")

    def unlink(self, comm_id: int) -> None:
        raise self._not_supported("unlink (HCCL ranktable mode; use unlink_clusters)")

    def query_register_mem_status(self, comm_id: int) -> Any:
        raise self._not_supported("query_register_mem_status (HCCL ranktable mode)")

    def finalize(self) -> None:
        if not self._is_initialized:
            return
        if self._cache_manager is not None:
            self._cache_manager._finalize()
        self._engine.close()
        self._engine = None
        self._is_initialized = False
        LLMDataDist.llm_engine_instance = None


def _shutdown_handler() -> None:
    instance = LLMDataDist.llm_engine_instance
    if instance is not None:
        try:
            instance.finalize()
        except LLMException as exc:
            logger.warning("error while finalizing llm datadist at exit: %s", exc)


atexit.register(_shutdown_handler)
