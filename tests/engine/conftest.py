"""Fixtures for the engine and datadist conformance tests: the API under test, peer processes
serving caches, and a client LLMDataDist in this process.

``--datadist=native`` (default) tests the project's engine; ``--datadist=llm_datadist`` runs the
same conformance tests against CANN's package (skipped where it is not installed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .datadist_harness import PEER, Client, NativePeer, Peer, Pusher, start_peer

BACKEND_OF_OPTION = {"native": "native", "llm_datadist": "ascend"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--datadist",
        choices=sorted(BACKEND_OF_OPTION),
        default="native",
        help="implementation of the LLM-DataDist v2 API to test",
    )


@pytest.fixture(scope="session")
def datadist_backend(request: pytest.FixtureRequest) -> str:
    return BACKEND_OF_OPTION[request.config.getoption("--datadist")]


@pytest.fixture(scope="session")
def api(datadist_backend: str) -> Any:
    """The API module under test (load_backend's result)."""
    from hixl_connector.datadist import BackendUnavailableError, load_backend

    try:
        return load_backend(datadist_backend)
    except BackendUnavailableError:
        pytest.skip("CANN llm_datadist is not installed")


@pytest.fixture(scope="module")
def peer_factory(api: Any, datadist_backend: str) -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def make(cluster_id: int, auth_token: str = "") -> Peer:
        peer = start_peer(cluster_id, datadist_backend, auth_token)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.stop()


@pytest.fixture(scope="module")
def client_factory(api: Any) -> Iterator[Callable[..., Client]]:
    """Builds the process's single LLMDataDist; a second call finalizes the first."""
    made: list[Client] = []

    def make(cluster_id: int = 1000, **extra: Any) -> Client:
        for old in made:
            old.dd.finalize()
        config = api.LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.sync_kv_timeout = extra.pop("sync_kv_timeout", 3000)
        for key, value in extra.items():
            setattr(config, key, value)
        dd = api.LLMDataDist(api.LLMRole.DECODER, cluster_id)
        dd.init(config.generate_options())
        client = Client(api, dd)
        made.append(client)
        return client

    yield make
    for client in made:
        client.dd.finalize()


@pytest.fixture(params=["cma", "tcp"])
def pusher(request: pytest.FixtureRequest, peer: NativePeer) -> Iterator[Pusher]:
    """A Pusher (cluster 80) linked over each transport to the module's ``peer`` (PEER)."""
    client = Pusher(80, request.param)
    client.link(peer)
    assert client.engine.peer_transport(PEER) == request.param
    yield client
    client.engine.close()
