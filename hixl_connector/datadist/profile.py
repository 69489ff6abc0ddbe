"""``Backend``, the typed seam between the connector and an implementation of the
LLM-DataDist v2 API, ``DataDist`` and ``BlocksCacheManager``, the part of that API the
connector calls, and ``BackendProfile``, what a backend needs from the code that opens it.

The connector's worker uses nothing but the LLM-DataDist API, through a ``Backend``
(``load_backend``). The few facts in which the backends differ (which memory they move,
LLMConfig fields, alignment, request-size limits) live in its profile, one per backend, and
only ``hixl_connector.connector.kv.registered_kv`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hixl_connector.datadist.api.llm_types import BlocksPull
from hixl_connector.datadist.api.pull_handle import PullHandle, ThreadPullHandle


def _host_memory_only(device: Any) -> bool:
    if device.type == "cpu":
        return False
    raise ValueError(
        f"the 'native' datadist back-end moves host memory only, but the KV cache lives on "
        f"{device}; use kv_connector_extra_config 'backend': 'ascend' on Ascend"
    )


def _no_alignment_rule(addrs: list[int], what: str) -> None:
    return None


def _device_zero(tensor: Any) -> int:
    return 0


def _unnamed_link(datadist: Any, remote_cluster_id: int) -> str:
    return "unknown"


def _never_in_place(datadist: Any, remote_cluster_id: int) -> bool:
    return False


# Where a method below has "/" and "*", the connector passes what precedes "/" by position
# and what follows "*" by name, and mypy compares the latter's names with an implementation's
# (it ignores the names of parameters that may be passed either way).


class BlocksCacheManager(Protocol):
    """What the connector calls on ``DataDist.cache_manager``, under CANN's names and
    parameters. Descriptors, keys and caches are each back-end's own classes, hence ``Any``.
    Batched asynchronous pulls are not part of it: CANN's cache manager has none, so the
    connector reaches them through ``Backend.pull_blocks_batch_async``."""

    def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: list[int],
        blocks_cache_key: Any = None,
        /,
        *,
        remote_accessible: bool | None = None,
    ) -> Any: ...

    def pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: list[int] | tuple[int, ...] | None = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None: ...

    def push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_blocks: list[int] | tuple[int, ...] = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        **kwargs: Any,
    ) -> None: ...

    # The native engine's write grants (write_grants.py; push mode refuses other back-ends).
    def grant_writes(self, cache: Any, writer_cluster_id: int, blocks: Sequence[int]) -> int: ...

    def revoke_writes(self, grant: int, timeout_ms: int = ...) -> None: ...

    def writes_landed(self) -> int: ...

    def wait_for_writes(self, seen: int, timeout_ms: int) -> int: ...


class DataDist(Protocol):
    """What the connector calls on an ``LLMDataDist``. Cluster infos and status codes are
    each back-end's own classes, hence ``Any``."""

    def init(self, options: dict[str, str], /) -> None: ...

    @property
    def cache_manager(self) -> BlocksCacheManager: ...

    def link_clusters(
        self, clusters: list[Any], timeout: int = 3000, /
    ) -> tuple[Any, list[Any]]: ...

    def unlink_clusters(
        self, clusters: list[Any], timeout: int = 3000, /, *, force: bool = False
    ) -> tuple[Any, list[Any]]: ...

    def finalize(self) -> None: ...


@dataclass(frozen=True)
class BackendProfile:
    name: str
    # LLMConfig.transfer_backend ("" leaves the engine's default).
    transfer_backend: str
    # Whether LLMConfig's hixl_* extension properties (native engine options) apply.
    native_options: bool
    # (the KV's torch device) -> whether its memory registers as Placement.DEVICE (else
    # HOST); raises ValueError for memory this back-end cannot move.
    registers_as_device: Callable[[Any], bool] = _host_memory_only
    # LLMConfig.device_id for the worker whose KV cache holds this tensor.
    device_id_of: Callable[[Any], int] = _device_zero
    # Raises ValueError when device addresses break the transport's alignment rule.
    check_device_alignment: Callable[[list[int], str], None] = _no_alignment_rule
    # (num_tensors of a cache) -> most block pairs per pull_blocks call; None: no limit.
    max_pairs_per_pull: Callable[[int], int] | None = None
    # (LLMDataDist, linked peer's cluster id) -> whether a read from that peer is a one-sided
    # copy out of this host's memory, which ends whatever the peer does (stopped: it
    # completes; dead: it fails at once). A network read waits on the peer.
    reads_in_place: Callable[[Any, int], bool] = _never_in_place
    # (LLMDataDist, linked peer's cluster id) -> the fabric that link uses, in words.
    describe_link: Callable[[Any, int], str] = _unnamed_link


def _cma_link(datadist: Any, remote_cluster_id: int) -> bool:
    return bool(datadist.peer_transport(remote_cluster_id) == "cma")


def _native_link(datadist: Any, remote_cluster_id: int) -> str:
    transport = datadist.peer_transport(remote_cluster_id)
    how = {"cma": "one-sided copies between processes of this host", "tcp": "TCP"}
    return f"native engine, {transport} ({how.get(transport, 'not linked')})"


NATIVE_PROFILE = BackendProfile(
    name="native",
    transfer_backend="",
    native_options=True,
    reads_in_place=_cma_link,
    describe_link=_native_link,
)


@dataclass(frozen=True)
class Backend:
    """One implementation of the LLM-DataDist v2 API: its classes and constants under CANN's
    names (None where that implementation lacks one), and what drives it beyond CANN's API:
    ``pull_blocks_batch_async(cache_manager, pulls)`` running ``BlocksPull``s in order (the
    first failure stopping the rest) and returning a handle with ``poll()``, ``wait()`` and
    ``finished_at``, the back-end's name and its profile."""

    BACKEND_NAME: str
    PROFILE: BackendProfile
    pull_blocks_batch_async: Callable[[Any, Sequence[BlocksPull]], PullHandle | ThreadPullHandle]
    # LLMDataDist(role, cluster_id), the role being the back-end's LLMRole.
    LLMDataDist: Callable[[Any, int], DataDist]
    LLMConfig: Any = None
    LlmConfig: Any = None
    LLMRole: Any = None
    LLMClusterInfo: Any = None
    LLMStatusCode: Any = None
    LLMException: Any = None
    Status: Any = None
    DataType: Any = None
    CacheDesc: Any = None
    Cache: Any = None
    CacheKey: Any = None
    CacheKeyByIdAndIndex: Any = None
    BlocksCacheKey: Any = None
    Placement: Any = None
    Memtype: Any = None
    RegisterMemStatus: Any = None
