from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# The tests import their helpers (vllm_harness, tiny_model) by module name.
sys.path.insert(0, str(Path(__file__).parent))
if importlib.util.find_spec("hixl_connector") is None:  # not pip-installed: use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
