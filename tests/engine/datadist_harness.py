"""Peers and clients of the datadist conformance tests: real processes, real sockets."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hixl_connector import _native

from .native_peer import MODEL_ID, NativePeer, pattern, start_ready, stop_peer_process
from .native_peer import start_peer as start_native_peer

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # the package, also when it is not pip-installed
    sys.path.insert(0, str(HERE.parents[1]))
PEER_SCRIPT = HERE / "datadist_peer.py"
PROMPT_SCRIPT = HERE / "prompt_peer.py"

# Hypothesis examples drawn against a module-scoped, linked setup that each example resets.
OVER_A_LINKED_SETUP = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# The native push tests' peer and the client engine that writes into it (Pusher).
PEER = 41
TENSORS, BLOCKS, BLOCK_BYTES = 4, 64, 4096
SRC_CACHE, BACK_CACHE = 70, 71
TIMEOUT_MS = 3000


class Pusher:
    """A client engine with a source cache of its own pattern and a read-back cache."""

    def __init__(self, cluster_id: int, transport: str) -> None:
        self.cluster_id = cluster_id
        self.engine = _native.Engine(cluster_id, transport=transport)
        nbytes = BLOCKS * BLOCK_BYTES
        self.src = [pattern(cluster_id, SRC_CACHE, t, nbytes).copy() for t in range(TENSORS)]
        self.back = [np.zeros(nbytes, np.uint8) for _ in range(TENSORS)]
        for cache_id, tensors in ((SRC_CACHE, self.src), (BACK_CACHE, self.back)):
            addrs = [t.ctypes.data for t in tensors]
            status, msg = self.engine.register_cache(
                cache_id, addrs, nbytes, BLOCKS, True, True, -1, []
            )
            assert status == _native.SUCCESS, msg

    def link(self, peer: NativePeer) -> None:
        assert self.engine.link(PEER, "127.0.0.1", peer.port, 3000) == (0, "")

    def push(
        self,
        src: list[int],
        dst: list[int],
        timeout_ms: int = TIMEOUT_MS,
        model_id: int = MODEL_ID,
        grant: int = 0,
    ) -> tuple[int, str]:
        return self.engine.push(
            PEER, model_id, SRC_CACHE, src, dst, 0, -1, 0, -1, timeout_ms, grant=grant
        )

    def peer_blocks(self, model_id: int = MODEL_ID) -> list[np.ndarray]:
        """The peer's whole blocks cache of `model_id`, read back with a pull."""
        ids = list(range(BLOCKS))
        status, msg = self.engine.pull(PEER, 0, model_id, -1, -1, -1, 0, BACK_CACHE, ids, ids,
                                       0, -1, 0, -1, TIMEOUT_MS)  # fmt: skip
        assert status == _native.SUCCESS, msg
        return [t.reshape(BLOCKS, BLOCK_BYTES).copy() for t in self.back]


def serving(cluster_id: int, **geometry: int) -> Iterator[NativePeer]:
    """A native peer for a fixture's lifetime: ``yield from serving(...)``."""
    peer = start_native_peer(cluster_id, "", **geometry)
    yield peer
    peer.stop()


def register_and_link(
    engine: Any,
    cache_id: int,
    tensors: list[np.ndarray],
    blocks: int,
    peer: NativePeer,
    timeout_ms: int,
) -> None:
    """Registers ``tensors`` (``blocks`` blocks each) as blocks cache ``cache_id`` of ``engine``
    and links it to ``peer``."""
    addrs = [t.ctypes.data for t in tensors]
    nbytes = tensors[0].nbytes
    assert engine.register_cache(cache_id, addrs, nbytes, blocks, True, True, -1, []) == (0, "")
    assert engine.link(peer.cluster_id, "127.0.0.1", peer.port, timeout_ms) == (0, "")


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

    @contextmanager
    def linked_over(self, peer: Reachable, transport: str) -> Iterator[None]:
        """Linked to ``peer`` inside the block, over ``transport`` (checked where the back-end
        says which), and unlinked after it."""
        ok = self.api.LLMStatusCode.LLM_SUCCESS
        assert self.link(peer) == (ok, [ok])
        if hasattr(self.dd, "peer_transport"):
            assert self.dd.peer_transport(peer.cluster_id) == transport
        try:
            yield
        finally:
            self.unlink(peer)

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


@st.composite
def block_pairs(draw: st.DrawFn, num_blocks: int) -> list[tuple[int, int]]:
    """(src, dst) block pairs: up to 24 distinct destinations, random sources or runs that
    are contiguous on both sides (so the planner merges them)."""
    count = draw(st.integers(1, 24))
    dst = draw(st.permutations(range(num_blocks)))[:count]
    if draw(st.booleans()):
        src = draw(st.lists(st.integers(0, num_blocks - 1), min_size=count, max_size=count))
    else:
        start = draw(st.integers(0, num_blocks - count))
        src = list(range(start, start + count))
        dst_start = draw(st.integers(0, num_blocks - count))
        dst = list(range(dst_start, dst_start + count))
    return list(zip(src, dst, strict=True))


def peer_took_command(peer: NativePeer, timeout_s: float = 5.0) -> None:
    """Waits until ``peer`` read every command line sent to it and its main thread, which runs
    the commands, is blocked: a command that returns at once has answered by then (its answer
    is on the peer's stdout, or was read from it)."""
    proc = peer.process
    stdin = proc.stdin
    assert stdin is not None

    def taken() -> bool:
        unread = struct.unpack("i", fcntl.ioctl(stdin, termios.FIONREAD, b"\0" * 4))[0]
        with open(f"/proc/{proc.pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return unread == 0 and state in ("S", "D")

    wait_until(taken, timeout_s, f"peer {peer.cluster_id} to take its command")


def peer_answered(peer: NativePeer) -> bool:
    """Whether an answer of ``peer`` waits on its stdout, unread."""
    stdout = peer.process.stdout
    assert stdout is not None
    return bool(select.select([stdout], [], [], 0)[0])


def wait_blocked(thread: threading.Thread, timeout_s: float = 5.0) -> None:
    """Waits until ``thread`` (started) is blocked in the kernel at two polls in a row, or has
    ended. This thread sleeps between the polls, so a thread that only waited for the GIL ran
    meanwhile: one blocked twice waits in its own call."""
    blocked_polls = [0]

    def blocked() -> bool:
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # it ended
            return True
        blocked_polls[0] = blocked_polls[0] + 1 if state in ("S", "D") else 0
        return blocked_polls[0] >= 2 or not thread.is_alive()

    wait_until(blocked, timeout_s, f"thread {thread.name} to block")


class LinkedSetup:
    """A client linked to a peer over one transport, and the key of the peer's blocks cache.
    ``linked`` is a module fixture's body: the setup, linked while the module's tests run."""

    def __init__(self, client: Client, peer: Peer, transport: str) -> None:
        self.client, self.peer, self.transport = client, peer, transport
        self.api = client.api
        self.key = self.api.BlocksCacheKey(peer.cluster_id, 0)

    @classmethod
    def linked(cls, client: Client, peer: Peer, transport: str) -> Iterator[Self]:
        setup = cls(client, peer, transport)
        with client.linked_over(peer, transport):
            yield setup
