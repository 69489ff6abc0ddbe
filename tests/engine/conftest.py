"""Fixtures for the engine and datadist conformance tests: the API under test, peer processes
serving caches, and a client LLMDataDist in this process.

``--datadist=native`` (default) tests the project's engine; ``--datadist=llm_datadist`` runs the
same conformance tests against CANN's package (skipped where it is not installed).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # the package, also when it is not pip-installed
    sys.path.insert(0, str(HERE.parents[1]))
PEER_SCRIPT = HERE / "datadist_peer.py"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
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


@dataclass
class Peer:
    cluster_id: int
    port: int
    pid: int
    caches: dict[str, int]
    process: subprocess.Popen[str]

    def stop(self) -> None:
        proc = self.process
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # in case a test stopped it
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=STOP_TIMEOUT_S)
            except (subprocess.TimeoutExpired, OSError, BrokenPipeError):
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)


def start_peer(cluster_id: int, backend: str, auth_token: str = "") -> Peer:
    env = {k: v for k, v in os.environ.items() if k != "HIXL_AUTH_TOKEN"}
    cmd = [sys.executable, str(PEER_SCRIPT), "--cluster-id", str(cluster_id), "--backend", backend]
    if auth_token:
        cmd += ["--auth-token", auth_token]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        raise RuntimeError(f"peer {cluster_id} did not become ready within {READY_TIMEOUT_S}s")
    info = json.loads(line)
    return Peer(cluster_id, info["port"], info["pid"], info["caches"], proc)


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


@dataclass
class Client:
    """The decode side in this process: an initialised LLMDataDist plus its host memory."""

    api: Any
    dd: Any
    keep: list[np.ndarray] = field(default_factory=list)

    def cluster_info(self, peer: Peer) -> Any:
        info = self.api.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", peer.port)
        return info

    def link(self, peer: Peer, timeout: int = 5000) -> Any:
        return self.dd.link_clusters([self.cluster_info(peer)], timeout)

    def unlink(self, peer: Peer, force: bool = False, timeout: int = 3000) -> Any:
        return self.dd.unlink_clusters([self.cluster_info(peer)], timeout, force)

    def blocks_cache(
        self,
        num_tensors: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        accessible: bool = True,
    ) -> tuple[Any, list[np.ndarray]]:
        block_bytes = int(np.prod(block_shape)) * 2
        tensors = [np.zeros(num_blocks * block_bytes, np.uint8) for _ in range(num_tensors)]
        self.keep += tensors
        desc = self.api.CacheDesc(
            num_tensors,
            [num_blocks, *block_shape],
            self.api.DataType.DT_BF16,
            self.api.Placement.HOST,
        )
        cache = self.dd.cache_manager.register_blocks_cache(
            desc, [t.ctypes.data for t in tensors], remote_accessible=accessible
        )
        return cache, tensors


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


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
