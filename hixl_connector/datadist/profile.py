"""``Backend``, the typed seam between the connector and an implementation of the
LLM-DataDist v2 API, and ``BackendProfile``, what a backend needs from the code that opens it.

The connector's worker uses nothing but the LLM-DataDist API, through a ``Backend``
(``load_backend``). The few facts in which the backends differ (which memory they move,
LLMConfig fields, alignment, request-size limits) live in its profile, one per backend, and
only ``hixl_connector.connector.engine_setup`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.datadist.llm_types import BlocksPull
from hixl_connector.datadist.pull_handle import PullHandle, ThreadPullHandle


def _no_alignment_rule(addrs: list[int], what: str) -> None:
    return None


def _device_zero(tensor: Any) -> int:
    return 0


@dataclass(frozen=True)
class BackendProfile:
    name: str
    # True: tensors on an accelerator register as Placement.DEVICE; False: host memory only.
    device_memory: bool
    # LLMConfig.transfer_backend ("" leaves the engine's default).
    transfer_backend: str
    # Whether LLMConfig's hixl_* extension properties (native engine options) apply.
    native_options: bool
    # LLMConfig.device_id for the worker whose KV cache holds this tensor.
    device_id_of: Callable[[Any], int] = _device_zero
    # Raises ValueError when device addresses break the transport's alignment rule.
    check_device_alignment: Callable[[list[int], str], None] = _no_alignment_rule
    # (num_tensors of a cache) -> most block pairs per pull_blocks call; None: no limit.
    max_pairs_per_pull: Callable[[int], int] | None = None


NATIVE_PROFILE = BackendProfile(
    name="native", device_memory=False, transfer_backend="", native_options=True
)


@dataclass(frozen=True)
class Backend:
    """One implementation of the LLM-DataDist v2 API: its classes and constants under CANN's
    names (None where that implementation lacks one), and what drives it beyond CANN's API:
    ``pull_blocks_async(cache_manager, key, cache, src, dst, **kwargs)`` returning a handle
    with ``wait()``, ``pull_blocks_batch_async(cache_manager, pulls)`` running ``BlocksPull``s
    in order (the first failure stopping the rest) and returning a handle with ``poll()``,
    ``wait()`` and ``finished_at``, the back-end's name and its profile."""

    BACKEND_NAME: str
    PROFILE: BackendProfile
    pull_blocks_async: Callable[..., Any]
    pull_blocks_batch_async: Callable[[Any, Sequence[BlocksPull]], PullHandle | ThreadPullHandle]
    LLMDataDist: Any = None
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
