"""``load_backend``: pick the implementation of the LLM-DataDist v2 API.

- "native": the project's C++ engine (host memory, any Linux host);
- "ascend": CANN ``llm_datadist`` (Atlas A2/A3 with torch_npu);
- "auto": ascend when both ``torch_npu`` and ``llm_datadist`` import and the KV tensors live on
  an NPU (``kv_device="npu"``; without a device, importability alone decides), else native.

Each returns a ``Backend`` (profile.py): the same API names plus
``pull_blocks_batch_async(cache_manager, pulls)``, ``BACKEND_NAME`` and ``PROFILE`` (a
``BackendProfile``). Loading "native" does not import the engine; ``LLMDataDist.init`` does.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from hixl_connector.datadist.api.llm_types import BlocksPull
from hixl_connector.datadist.ascend import cann as ascend
from hixl_connector.datadist.ascend.cann import API_NAMES, BackendUnavailableError
from hixl_connector.datadist.ascend.checked_classes import CheckedCacheManager
from hixl_connector.datadist.native.cache_manager import CacheManager
from hixl_connector.datadist.native.llm_datadist import LLMDataDist
from hixl_connector.datadist.profile import NATIVE_PROFILE, Backend, BlocksCacheManager, DataDist

BACKENDS = ("native", "ascend", "auto")


# Never called: mypy rejects these returns when a class stops satisfying the protocol the
# connector types it by (a renamed method, a changed parameter), which nothing else would
# notice until a test or a run called it. CANN's own classes are untyped; what can be checked
# of the ascend backend is the project's wrapper of its cache manager (whose __getattr__
# hides a missing method from mypy, but not a changed signature).
def _native_conforms(datadist: LLMDataDist) -> DataDist:
    return datadist


def _native_cache_manager_conforms(manager: CacheManager) -> BlocksCacheManager:
    return manager


def _ascend_cache_manager_conforms(manager: CheckedCacheManager) -> BlocksCacheManager:
    return manager


def _native_pull_blocks_batch_async(cache_manager: Any, pulls: Sequence[BlocksPull]) -> Any:
    return cache_manager.pull_blocks_batch_async(pulls)


def _load_native() -> Backend:
    api = importlib.import_module("hixl_connector.datadist")
    return Backend(
        BACKEND_NAME="native",
        PROFILE=NATIVE_PROFILE,
        pull_blocks_batch_async=_native_pull_blocks_batch_async,
        **{name: getattr(api, name) for name in API_NAMES},
    )


def resolve_backend(name: str = "auto", kv_device: str | None = None) -> str:
    """The concrete backend ("native" or "ascend") that ``name`` selects here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown datadist backend {name!r}; choose one of {BACKENDS}")
    if name != "auto":
        return name
    if kv_device is not None and kv_device != "npu":
        return "native"
    return "ascend" if ascend.ascend_available() else "native"


def load_backend(name: str = "auto", kv_device: str | None = None) -> Backend:
    """``kv_device``: the device type of the KV tensors ("cpu", "npu", ...), for "auto"."""
    if resolve_backend(name, kv_device) == "native":
        return _load_native()
    return ascend.load()


__all__ = ["BACKENDS", "Backend", "BackendUnavailableError", "load_backend", "resolve_backend"]
