from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

# The tests import their helpers (vllm_harness, tiny_model) by module name.
sys.path.insert(0, str(Path(__file__).parent))
if importlib.util.find_spec("hixl_connector") is None:  # not pip-installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(params=[False, True], ids=["sync-scheduling", "async-scheduling"])
def scheduling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """vLLM's scheduler, synchronous and asynchronous (0.32's default), for the tests that
    drive it (``pytestmark = pytest.mark.usefixtures("scheduling")``)."""
    import vllm_harness

    monkeypatch.setattr(vllm_harness, "ASYNC_SCHEDULING", request.param)
    return bool(request.param)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A zmq context for one test, terminated after it (every socket must be closed)."""
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def conv_layout_ds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's DS conv-state layout for one test (vLLM caches the layout it read first)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    yield
    get_conv_state_layout.cache_clear()
