"""The "ascend" backend: CANN's own ``llm_datadist`` package (needs torch_npu on Atlas A2/A3).

Everything is CANN's, except two project adaptations: ``LLMDataDist.init`` drops the native
engine's ``hixl.*`` option keys, and ``pull_blocks_async`` is emulated by running
``pull_blocks`` on a thread (CANN has no asynchronous pull).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from hixl_connector.datadist.pull_handle import ThreadPullHandle

API_NAMES = (
    "LLMDataDist",
    "LLMConfig",
    "LlmConfig",
    "LLMRole",
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "Status",
    "DataType",
    "CacheDesc",
    "Cache",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "Placement",
    "Memtype",
    "RegisterMemStatus",
)


class BackendUnavailableError(ImportError):
    """The requested backend's packages cannot be imported here."""


def import_cann() -> Any:
    try:
        return importlib.import_module("llm_datadist")
    except ImportError as exc:
        raise BackendUnavailableError(
            "the 'ascend' datadist backend needs CANN's `llm_datadist` package (shipped with the "
            f"CANN toolkit, used with torch_npu); it cannot be imported here: {exc}"
        ) from exc


def pull_blocks_async(cache_manager: Any, *args: Any, **kwargs: Any) -> ThreadPullHandle:
    return ThreadPullHandle(cache_manager.pull_blocks, *args, **kwargs)


def load() -> types.ModuleType:
    cann = import_cann()
    module = types.ModuleType("hixl_connector.datadist.backends.ascend")
    for name in API_NAMES:
        if hasattr(cann, name):
            setattr(module, name, getattr(cann, name))

    class LLMDataDist(cann.LLMDataDist):  # type: ignore[name-defined]
        def init(self, options: dict[str, str]) -> None:
            if isinstance(options, dict):
                options = {k: v for k, v in options.items() if not k.startswith("hixl.")}
            super().init(options)

    module.LLMDataDist = LLMDataDist  # type: ignore[attr-defined]
    module.pull_blocks_async = pull_blocks_async  # type: ignore[attr-defined]
    module.BACKEND_NAME = "ascend"  # type: ignore[attr-defined]
    return module
