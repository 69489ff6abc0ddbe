"""STAND-IN for CANN's ``llm_datadist`` package. Not CANN, not Ascend: a test double.

It lets the connector's "ascend" back-end (``hixl_connector.datadist.ascend``) run on a host
without CANN. It exposes only the documented LLM-DataDist v2 surface (no native-engine
extensions such as ``listen_port`` or ``pull_blocks_async``), moves the bytes with the
project's native engine (through ``hixl_connector.datadist``), records every documented call
in order (``calls()``), and raises as CANN does when a rule is broken:

- a second ``LLMDataDist`` in the process: ``LLMException(LLM_FAILED)``;
- memory registered after ``link_clusters`` is not remotely accessible (CANN: "memory
  registered after linking does not support remote access"), so a pull into it raises
  ``LLM_PARAM_INVALID`` and a pull of it from a peer linked earlier ``LLM_KV_CACHE_NOT_EXIST``;
- a destination cache that is not remote-accessible: ``LLM_PARAM_INVALID``;
- a request over CANN's buffer (2 MiB with remote access, 112 KiB without): ``LLM_PARAM_INVALID``;
- a reused ``(cluster_id, model_id)`` key: CANN silently re-points the key (last wins), which
  would only show as wrong KV; the stand-in is stricter and raises ``LLMException(LLM_FAILED)``,
  the status CANN gives a duplicate key of ``register_cache`` (CACHE_KEY_ALREADY_EXIST).

Device memory is played by host memory: a ``Placement.DEVICE`` cache is registered with the
native engine as host memory. Nothing here proves the NPU, HCCS or RoCE path.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from hixl_connector.connector.blocks import group_runs
from hixl_connector.datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Memtype,
    Placement,
    RegisterMemStatus,
    Status,
)
from hixl_connector.datadist import LLMConfig as _ProjectLLMConfig
from hixl_connector.datadist import LLMDataDist as _NativeLLMDataDist

STANDIN = True
REQUEST_LIMIT_BYTES = 2 * 1024 * 1024
REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE = 112 * 1024
REQUEST_HEADER_BYTES = 256  # the stand-in's guess; the connector keeps a far wider margin
REQUEST_ENTRY_BYTES = 16
# Native transport under the stand-in ("tcp" lets a stopped peer time a pull out).
TRANSPORT_ENV = "HIXL_STANDIN_TRANSPORT"

logger = logging.getLogger(__name__)
_calls: list[str] = []
_calls_lock = threading.Lock()


def _record(name: str) -> None:
    with _calls_lock:
        _calls.append(name)


def calls() -> list[str]:
    """The documented API calls made in this process, in order (stand-in only)."""
    with _calls_lock:
        return list(_calls)


def _param(message: str) -> LLMException:
    return LLMException(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _not_emulated(what: str) -> LLMException:
    return LLMException(
        f"{what} is not emulated by the llm_datadist stand-in",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    )


class LLMConfig(_ProjectLLMConfig):
    """CANN's LLMConfig has no ``hixl_*`` properties; setting one is a back-end bug."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("hixl_"):
            raise AttributeError(f"CANN's LLMConfig has no attribute {name!r}")
        super().__setattr__(name, value)


LlmConfig = LLMConfig


class CacheManager:
    def __init__(self, native: Any, owner: LLMDataDist, remote_accessible_mode: bool) -> None:
        self._native = native
        self._owner = owner
        self._remote_accessible_mode = remote_accessible_mode
        self._keys: set[tuple[int, int]] = set()

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        _record("register_blocks_cache")
        if isinstance(blocks_cache_key, BlocksCacheKey):
            key = (blocks_cache_key.cluster_id, blocks_cache_key.model_id)
            if key in self._keys:
                raise LLMException(
                    f"register_blocks_cache failed, error code is {LLMStatusCode.LLM_FAILED}, "
                    f"CACHE_KEY_ALREADY_EXIST: BlocksCacheKey{key} is registered already (CANN "
                    "re-points it silently; give every cache its own model_id)",
                    status_code=LLMStatusCode.LLM_FAILED,
                )
            self._keys.add(key)
        if isinstance(cache_desc, CacheDesc) and remote_accessible is None:
            remote_accessible = cache_desc.placement == Placement.DEVICE
        if self._owner.linked and remote_accessible:
            logger.warning(
                "stand-in: cache registered after link_clusters is not remote accessible"
            )
            remote_accessible = False
        return self._native.register_blocks_cache(
            _as_host(cache_desc), addrs, blocks_cache_key, remote_accessible
        )

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        _record("register_cache")
        if self._owner.linked:
            remote_accessible = False
        return self._native.register_cache(
            _as_host(cache_desc), addrs, cache_keys, remote_accessible
        )

    def unregister_cache(self, cache_id: int) -> None:
        _record("unregister_cache")
        self._native.unregister_cache(cache_id)

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] | None = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None:
        _record("pull_blocks")
        self._check_request_size(dst_cache, src_blocks, dst_blocks)
        self._native.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, **kwargs)

    def _check_request_size(self, dst_cache: Any, src: Any, dst: Any) -> None:
        """CANN's row 22, checked before the native call (for well-typed lists only)."""
        if not isinstance(dst_cache, Cache) or not isinstance(src, (list, tuple)):
            return
        if not isinstance(dst, (list, tuple)) or len(src) != len(dst) or not src:
            return
        if not all(isinstance(b, int) for b in (*src, *dst)):
            return
        runs = len(group_runs(src, dst))
        size = REQUEST_HEADER_BYTES + REQUEST_ENTRY_BYTES * (
            dst_cache.cache_desc.num_tensors + 2 * runs
        )
        limit = (
            REQUEST_LIMIT_BYTES
            if self._remote_accessible_mode
            else REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE
        )
        if size > limit:
            raise _param(
                f"pull_blocks failed, error code is {LLMStatusCode.LLM_PARAM_INVALID}, request "
                f"of {len(src)} blocks in {runs} runs needs {size} bytes > buffer {limit}"
            )

    def pull_cache(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("pull_cache")

    def push_blocks(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("push_blocks")

    def push_cache(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("push_cache")

    def transfer_cache_async(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("transfer_cache_async")

    def remap_registered_memory(self, *args: Any, **kwargs: Any) -> None:
        raise _not_emulated("remap_registered_memory")


def _as_host(desc: Any) -> Any:
    if not isinstance(desc, CacheDesc) or desc.placement == Placement.HOST:
        return desc
    return CacheDesc(
        desc.num_tensors, list(desc.shape), desc.data_type, Placement.HOST, desc.batch_dim
    )


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        _record("LLMDataDist")
        self._native = _NativeLLMDataDist(role, cluster_id)
        self._cache_manager: CacheManager | None = None
        self.linked = False

    def init(self, options: dict[str, str]) -> None:
        _record("init")
        if self._cache_manager is not None:
            return
        foreign = sorted(k for k in options if not k.startswith(("llm.", "ge.")))
        if foreign:
            raise _param(f"option keys {foreign} are not CANN options")
        native_options = dict(options)
        native_options["hixl.transport"] = os.environ.get(TRANSPORT_ENV, "auto")
        self._native.init(native_options)  # a second instance raises LLM_FAILED here
        accessible = native_options.get("llm.EnableRemoteCacheAccessible") == "1" or bool(
            native_options.get("llm.LocalCommRes") or native_options.get("llm.TransferBackend")
        )
        self._cache_manager = CacheManager(self._native.cache_manager, self, accessible)

    @property
    def cache_manager(self) -> CacheManager:
        if self._cache_manager is None:
            raise RuntimeError("llm datadist is not initialized")
        return self._cache_manager

    def link_clusters(
        self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        _record("link_clusters")
        status, per_cluster = self._native.link_clusters(clusters, timeout)
        if any(code == LLMStatusCode.LLM_SUCCESS for code in per_cluster):
            self.linked = True
        return status, per_cluster

    def unlink_clusters(
        self,
        clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
        timeout: int = 3000,
        force: bool = False,
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        _record("unlink_clusters(force)" if force else "unlink_clusters")
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
        _record("finalize")
        self._native.finalize()
        self._cache_manager = None


__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LlmConfig",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "calls",
]
