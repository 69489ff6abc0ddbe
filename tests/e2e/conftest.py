"""Fixtures for end-to-end tests with real vLLM CPU servers and the vLLM router.

- ``tiny_model_dir`` (session): the tiny random Llama, built once into a temporary directory.
- ``e2e_log_dir`` (session): where every server and router writes its log.
- ``plain_server`` (session): a vLLM server without a connector, for reference outputs.
- ``reference_outputs`` (session): greedy token ids of the plain server for the test prompts.
- ``plain_outputs`` (session): the same for the token prompts of ``harness.PROMPTS`` and chat.
- ``pd_factory`` (function): ``pd_factory(prefill_config, decode_config, with_router=True)``
  starts P and D (and the router) and returns a ``PDDeployment``; all stopped at teardown.

When a test fails, the tails of all process logs are attached to its report.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import Generation, chat, complete
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, VllmServer, start_vllm_server

from .harness import (
    CHAT_MESSAGES,
    MAX_TOKENS,
    PROMPTS,
    PDLauncher,
    ProcessRegistry,
    e2e_prompts,
    tiny_model_or_skip,
)

_REGISTRY = pytest.StashKey[ProcessRegistry]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REGISTRY] = ProcessRegistry()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    registry = item.config.stash.get(_REGISTRY, None)
    if report.failed and registry is not None:
        report.sections.append(("vLLM / router log tails", registry.log_report()))


@pytest.fixture(scope="session")
def process_registry(request: pytest.FixtureRequest) -> ProcessRegistry:
    return request.config.stash[_REGISTRY]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_or_skip(tmp_path_factory, "end-to-end", "tiny_model")


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e_logs")


@pytest.fixture(scope="session")
def plain_server(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[VllmServer]:
    # Core 0 is shared with P later; an idle vLLM server does not spin.
    server = start_vllm_server(tiny_model_dir, e2e_log_dir, "plain", core=0)
    process_registry.add(server)
    try:
        server.wait_healthy(300.0)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def reference_outputs(plain_server: VllmServer) -> dict[str, Generation]:
    """Greedy outputs of the plain server: one per prompt, keyed by prompt, plus "chat"."""
    outputs = {
        prompt: complete(plain_server.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        for prompt in e2e_prompts()
    }
    outputs["chat"] = chat(
        plain_server.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS
    )
    return outputs


@pytest.fixture(scope="session")
def plain_outputs(plain_server: VllmServer) -> dict[Any, Generation]:
    """Greedy outputs of the plain server for the token prompts of ``PROMPTS``, plus "chat"."""
    outputs: dict[Any, Generation] = {
        n: complete(plain_server.url, p, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        for n, p in PROMPTS.items()
    }
    outputs["chat"] = chat(
        plain_server.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS
    )
    return outputs


@pytest.fixture
def pd_factory(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[PDLauncher]:
    with PDLauncher(tiny_model_dir, e2e_log_dir, process_registry) as launcher:
        yield launcher
