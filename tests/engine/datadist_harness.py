"""Peers and clients of the datadist conformance tests: real processes, real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .native_peer import NativePeer, start_ready, stop_peer_process

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # the package, also when it is not pip-installed
    sys.path.insert(0, str(HERE.parents[1]))
PEER_SCRIPT = HERE / "datadist_peer.py"
PROMPT_SCRIPT = HERE / "prompt_peer.py"


@dataclass
class Peer:
    cluster_id: int
    port: int
    pid: int
    caches: dict[str, int]
    process: subprocess.Popen[str]

    def stop(self) -> None:
        stop_peer_process(self.process)


def start_peer(cluster_id: int, backend: str, auth_token: str = "") -> Peer:
    env = {k: v for k, v in os.environ.items() if k != "HIXL_AUTH_TOKEN"}
    cmd = [sys.executable, str(PEER_SCRIPT), "--cluster-id", str(cluster_id), "--backend", backend]
    if auth_token:
        cmd += ["--auth-token", auth_token]
    proc, info = start_ready(cmd, f"peer {cluster_id}", env)
    return Peer(cluster_id, info["port"], info["pid"], info["caches"], proc)


def start_prompt_side(cluster_id: int, transport: str) -> NativePeer:
    """A prompt side that answers commands (prompt_peer.py): switch, link, unlink, push."""
    cmd = [sys.executable, str(PROMPT_SCRIPT), "--cluster-id", str(cluster_id)]
    process, info = start_ready(cmd + ["--transport", transport], "prompt peer")
    return NativePeer(cluster_id, process, info)


class Reachable(Protocol):
    """A peer process on 127.0.0.1: a datadist Peer or a NativePeer."""

    @property
    def cluster_id(self) -> int: ...
    @property
    def port(self) -> int: ...


@dataclass
class Client:
    """The decode side in this process: an initialised LLMDataDist plus its host memory."""

    api: Any
    dd: Any
    keep: list[np.ndarray] = field(default_factory=list)

    def cluster_info(self, peer: Reachable) -> Any:
        info = self.api.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", peer.port)
        return info

    def link(self, peer: Reachable, timeout: int = 5000) -> Any:
        return self.dd.link_clusters([self.cluster_info(peer)], timeout)

    def unlink(self, peer: Reachable, force: bool = False, timeout: int = 3000) -> Any:
        return self.dd.unlink_clusters([self.cluster_info(peer)], timeout, force)

    def blocks_cache(
        self,
        num_tensors: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        accessible: bool = True,
        key: Any = None,
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
            desc, [t.ctypes.data for t in tensors], key, remote_accessible=accessible
        )
        return cache, tensors


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
