"""D reads prefill ranks at 50 successive addresses, each stopped after its read, the way an
autoscaled fleet replaces P instances: D's native links, threads and fds stay bounded while
it does and return to their baseline after; no successor is refused for the cluster id a
stopped P held (every P here announces the same one).

Real processes and the real engine over TCP: D is this process's LLMDataDist with the
connector's PeerRegistry; each P is prefill_rank_peer.py.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.link_reports import LinkReporter
from hixl_connector.connector.peers.registry import PeerRegistry

from .datadist_harness import Client
from .datadist_peer import BLOCK_SHAPE, NUM_BLOCKS, NUM_TENSORS, SEED, tensor_bytes
from .native_peer import start_ready, stop_peer_process
from .prefill_rank_peer import announcement

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "prefill_rank_peer.py")
ADDRESSES = 50
CLUSTER = 7100  # every P announces it: a successor takes it over from a stopped P
IDLE_S = 1.5
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2


def start_prefill(i: int) -> tuple[Any, RemoteEndpoint]:
    engine_id = f"prefill-{i}"
    cmd = [sys.executable, PEER_SCRIPT, "--engine-id", engine_id, "--cluster-id", str(CLUSTER)]
    proc, info = start_ready(cmd, engine_id)
    return proc, RemoteEndpoint(engine_id, "127.0.0.1", info["side_channel_port"], 1, CLUSTER)


def resources(client: Client) -> tuple[int, int, int]:
    """(native links, threads, fds) of this process."""
    links = int(client.dd.engine_stats()["open_links"])
    return links, len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def settle(peers: PeerRegistry, client: Client, done: Callable[[], bool], bound_s: float) -> None:
    """Asks for idle links to close, as D's steps do, until ``done`` or the bound."""
    deadline = time.monotonic() + bound_s
    while not done():
        assert time.monotonic() < deadline, f"not settled: {resources(client)}"
        peers.close_idle(time.monotonic())
        time.sleep(0.05)


def test_reading_prefills_at_50_successive_addresses_leaves_nothing_behind(
    api: Any, client_factory: Callable[..., Client]
) -> None:
    client = client_factory(1000, hixl_transport="tcp")
    dst_cache, dst = client.blocks_cache(NUM_TENSORS, 2, BLOCK_SHAPE)
    context = zmq.Context()
    counted: list[str] = []
    config = HixlConfig.from_dict(
        {"handshake_timeout_s": 2.0, "pull_timeout_s": 1.0, "link_idle_s": IDLE_S}, "decode"
    )
    local = announcement("decode", 1000, 1)
    peers = PeerRegistry(
        api, client.dd, context, local, config, lambda _: False, counted.append, LinkReporter(0)
    )
    seen: list[tuple[int, int, int]] = []

    def read(proc: Any, remote: RemoteEndpoint, i: int) -> None:
        peer = peers.get(remote.rank(0))
        block = i % NUM_BLOCKS
        client.dd.cache_manager.pull_blocks(api.BlocksCacheKey(CLUSTER, 0), dst_cache, [block], [0])
        for t, tensor in enumerate(dst):
            served = tensor_bytes(SEED, "kv", t, NUM_BLOCKS * BLOCK_BYTES)
            expected = served[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES]
            assert np.array_equal(tensor[:BLOCK_BYTES], expected), f"P {i}: wrong bytes"
        peers.read_through(remote, [peer])
        peers.close_idle(time.monotonic())
        stop_peer_process(proc)

    upcoming = start_prefill(0)
    try:
        read(*upcoming, 0)  # warms D up: its baseline is taken after the first link's life
        settle(peers, client, lambda: resources(client)[0] == 0, IDLE_S + 5)
        baseline = resources(client)
        upcoming = start_prefill(1)
        for i in range(1, ADDRESSES + 1):
            proc, remote = upcoming
            if i < ADDRESSES:
                upcoming = start_prefill(i + 1)  # starts while D reads this one
            read(proc, remote, i)
            seen.append(resources(client))
        assert max(links for links, _, _ in seen) <= 2, seen
        assert max(threads for _, threads, _ in seen) <= baseline[1] + 8, (baseline, seen)
        assert max(fds for _, _, fds in seen) <= baseline[2] + 16, (baseline, seen)
        settle(peers, client, lambda: resources(client) == baseline, IDLE_S + 10)
        assert "idle_unlinks" in counted
    finally:
        stop_peer_process(upcoming[0])
        peers.close()
        context.term()
