"""LLMDataDist of the LLM-DataDist v2 API on the project's native engine.

The engine module ``hixl_connector._native`` is imported on ``init``, not at import time.
"""

from __future__ import annotations

import atexit
import itertools
import logging
from typing import Any, ClassVar

from hixl_connector.datadist.api.c_types import (
    check_int32,
    check_isinstance,
    check_uint32,
    check_uint64,
    to_int64,
)
from hixl_connector.datadist.api.cluster_info import LLMClusterInfo, LLMRole, int_to_ip
from hixl_connector.datadist.api.llm_types import RegisterMemStatus
from hixl_connector.datadist.api.status import (
    LLMException,
    LLMStatusCode,
    code_to_status,
    raise_if_false,
)
from hixl_connector.datadist.native.cache_manager import CacheManager
from hixl_connector.datadist.native.engine_options import (
    AUTH_TOKEN_ENV,
    derived_options,
    int_option,
    parse_listen_ip_info,
)
from hixl_connector.datadist.native.engine_options import engine_args as engine_args_of
from hixl_connector.datadist.native.parity.rank_table import Comm, base_port, rank_hosts

logger = logging.getLogger(__name__)
DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
MAX_CLUSTERS_PER_CALL = 16
MAX_COMMS = 512
__all__ = ["AUTH_TOKEN_ENV", "LLMDataDist", "load_native"]
# The bindings this module is written against (``ABI_VERSION`` in native/bindings/module.cpp):
# an extension built from other sources would fail later, on some name or argument.
NATIVE_ABI_VERSION = 9


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
        self._comms: dict[int, Comm] = {}
        self._comm_ids = itertools.count(1)

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
        opts = derived_options(options, _role_name(self._role))
        engine_args = engine_args_of(opts)
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
        timeout = int_option(
            opts, "llm.SyncKvCacheWaitTime", DEFAULT_SYNC_KV_TIMEOUT_MS, 1, 2**31 - 1
        )
        self._options = opts
        self._cache_manager = CacheManager(self._engine, opts, timeout)
        LLMDataDist.llm_engine_instance = self
        self._is_initialized = True

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

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """As CANN's default back-end: refused while this engine holds links; with
        ``llm.listenIpInfo`` in the options the engine listens there (moving from another
        port), without it stops listening. Links go both ways (README: "Links go both
        ways"), so a peer that links here after the switch can be pushed to."""
        self._check_is_inited()
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_isinstance("switch_options", switch_options, dict)
        options = dict(switch_options or {})
        raise_if_false(
            int(self._engine.stats()["open_links"]) == 0 and not self._comms,
            "switch_role: unlink every cluster first",
            status_code=LLMStatusCode.LLM_EXIST_LINK,
        )
        listen = options.get("llm.listenIpInfo")
        if listen:
            host, port = parse_listen_ip_info(listen)
            if self._engine.listen_port not in (-1, port):
                self._engine.stop_listening()
            status, _, message = self._engine.listen(host, port)
            raise_if_false(
                status == 0,
                f"[switch_role] cannot listen on {listen}: {message}",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            )
        else:
            self._engine.stop_listening()
        self._role = role

    # --- rank-table links (rank_table.py) -----------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Collective: every member calls it. Returns the comm id at once; poll
        ``query_register_mem_status`` until OK before transferring."""
        self._check_is_inited()
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        raise_if_false(0 < len(comm_name) < 128, "comm_name must have 1 to 127 characters")
        check_isinstance("cluster_rank_info", cluster_rank_info, dict, int, allow_none=False)
        raise_if_false(len(cluster_rank_info) <= 4, "cluster_rank_info holds at most 4 clusters")
        for cluster, rank in cluster_rank_info.items():
            check_uint64("cluster_rank_info key", cluster)
            check_uint32("cluster_rank_info value", rank)
        check_isinstance("rank_table", rank_table, str)
        raise_if_false(len(cluster_rank_info) > 1, "cluster num must be bigger than 1.")
        ranks = list(cluster_rank_info.values())
        raise_if_false(ranks == sorted(ranks), "rank in cluster_rank_info must be ordered")
        raise_if_false(
            "llm.TransferBackend" not in self._options,
            "link is not supported with llm.TransferBackend: use link_clusters",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
        raise_if_false(
            self._cluster_id in cluster_rank_info,
            f"cluster {self._cluster_id} (this one) is not in cluster_rank_info",
        )
        raise_if_false(len(self._comms) < MAX_COMMS, f"at most {MAX_COMMS} comms")
        hosts = rank_hosts(rank_table or "")
        base = base_port()
        for cluster, rank in cluster_rank_info.items():
            raise_if_false(rank in hosts, f"rank {rank} of cluster {cluster} is not in rank_table")
        mine = cluster_rank_info[self._cluster_id]
        status, _, message = self._engine.listen(hosts[mine], base + mine)
        raise_if_false(
            status == 0,
            f"[link] cannot listen on {hosts[mine]}:{base + mine}: {message}",
            status_code=LLMStatusCode.LLM_LINK_FAILED,
        )
        peers = {
            to_int64(c): (hosts[r], base + r)
            for c, r in cluster_rank_info.items()
            if c != self._cluster_id
        }
        comm_id = next(self._comm_ids)
        self._comms[comm_id] = Comm(self._engine, peers)
        self.cache_manager._linked_by_rank_table = True
        return comm_id

    def _comm(self, comm_id: Any) -> Comm:
        self._check_is_inited()
        check_isinstance("comm_id", comm_id, int, allow_none=False)
        check_uint64("comm_id", comm_id)
        comm = self._comms.get(comm_id)
        raise_if_false(
            comm is not None,
            f"comm {comm_id} is not linked",
            status_code=LLMStatusCode.LLM_NOT_YET_LINK,
        )
        assert comm is not None
        return comm

    def unlink(self, comm_id: int) -> None:
        self._comm(comm_id).unlink()
        del self._comms[comm_id]

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        return self._comm(comm_id).status()

    def finalize(self) -> None:
        if not self._is_initialized:
            return
        for comm in self._comms.values():
            comm.unlink()
        self._comms.clear()
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
