"""``load_backend``: pick the implementation of the LLM-DataDist v2 API.

- "native": the project's C++ engine (host memory, any Linux host);
- "ascend": CANN ``llm_datadist`` (Atlas A2/A3 with torch_npu);
- "auto": ascend when both ``torch_npu`` and ``llm_datadist`` import, else native.

Each returns a module-like object with the same API names plus ``pull_blocks_async(cache_manager,
...)`` and ``BACKEND_NAME``. Loading "native" does not import the engine; ``LLMDataDist.init``
does.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from hixl_connector.datadist import ascend
from hixl_connector.datadist.ascend import API_NAMES, BackendUnavailableError

BACKENDS = ("native", "ascend", "auto")


def _native_pull_blocks_async(cache_manager: Any, *args: Any, **kwargs: Any) -> Any:
    return cache_manager.pull_blocks_async(*args, **kwargs)


def _load_native() -> types.ModuleType:
    api = importlib.import_module("hixl_connector.datadist")
    module = types.ModuleType("hixl_connector.datadist.backends.native")
    for name in API_NAMES:
        setattr(module, name, getattr(api, name))
    module.pull_blocks_async = _native_pull_blocks_async  # type: ignore[attr-defined]
    module.BACKEND_NAME = "native"  # type: ignore[attr-defined]
    return module


def _ascend_available() -> bool:
    try:
        importlib.import_module("torch_npu")
        importlib.import_module("llm_datadist")
    except Exception:  # any failure to import means "not usable here"
        return False
    return True


def load_backend(name: str = "auto") -> types.ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown datadist backend {name!r}; choose one of {BACKENDS}")
    if name == "native" or (name == "auto" and not _ascend_available()):
        return _load_native()
    return ascend.load()


__all__ = ["BACKENDS", "BackendUnavailableError", "load_backend"]
