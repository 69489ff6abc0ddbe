"""A real decode HixlWorker (native engine, real sockets) fed kv_transfer_params naming many
distinct fake prefill addresses: its per-address state must not grow with them.

The addresses are closed ports on 127.0.0.1, so every handshake, release and heartbeat fails
after `handshake_timeout_s`, as it would for a client inventing addresses.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.vllm_scheduler import vllm_config

with standin_helpers_importable():
    from worker_harness import kv_caches, tp_group

ADDRESSES_PER_ROUND = 24
ROUNDS = 2
TRANSFER_THREADS = 2
HEARTBEAT_S = 0.01
RESULT_TIMEOUT_S = 60.0


def closed_ports(n: int) -> list[int]:
    """Ports that were just free on 127.0.0.1 and have nothing listening now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path) -> Iterator[Any]:
    from hixl_connector.connector.config import HixlConfig
    from hixl_connector.connector.worker.half import HixlWorker

    extra = {
        "backend": "native",
        "handshake_timeout_s": 0.05,
        "transfer_threads": TRANSFER_THREADS,
        "heartbeat_s": HEARTBEAT_S,
        "lease_s": 1.0,
    }
    config = vllm_config(tiny_model_dir, "kv_consumer", engine_id="d-bounds", extra=extra)
    with tp_group(config, free_port()):
        hixl = HixlWorker(config, HixlConfig.from_vllm_config(config), "d-bounds")
        try:
            hixl.register_kv_caches(dict(kv_caches(fill=False)))
            yield hixl
        finally:
            hixl.shutdown()


def per_peer_state_sizes(worker: Any) -> tuple[int, int, int]:
    """(linked peers, address locks, heartbeat peers): client-named, so kept bounded."""
    peers, notices = worker._decode.peers, worker._decode.lease_client
    return len(peers._peers), len(peers._locks), notices._heartbeats.tracked_peers()


def _specs(round_: int, ports: list[int]) -> tuple[list[Any], list[Any]]:
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.metadata import RecvSpec, WaitingRead

    recvs, beats = [], []
    for i, port in enumerate(ports):
        remote = RemoteEndpoint(f"fake-{round_}-{i}", "127.0.0.1", port, 1, 5000 + i)
        recvs.append(RecvSpec(f"d-{round_}-{i}", f"p-{i}", i, remote, (i % 8,), (i % 8,)))
        beats.append(WaitingRead(f"d-{round_}-{i}", remote, f"p-{i}", i))
    # Two more pulls from the first address: threads then share (and wait on) one lock.
    recvs += [
        RecvSpec(f"d-{round_}-again-{k}", "p-0", 0, recvs[0].remote, (0,), (0,)) for k in (0, 1)
    ]
    return recvs, beats


def test_many_fake_addresses_leave_no_per_address_state(worker: Any) -> None:
    from hixl_connector.connector.metadata import HixlConnectorMetadata

    most_locks = 0
    for round_ in range(ROUNDS):
        recvs, beats = _specs(round_, closed_ports(ADDRESSES_PER_ROUND))
        worker.start_load_kv(HixlConnectorMetadata(to_recv=recvs, waiting=beats))
        assert per_peer_state_sizes(worker)[2] == ADDRESSES_PER_ROUND  # leases tracked
        time.sleep(HEARTBEAT_S)  # the leases waited that long: their heartbeats are due
        worker.start_load_kv(HixlConnectorMetadata())
        assert per_peer_state_sizes(worker)[2] == ADDRESSES_PER_ROUND  # heartbeats in flight
        pending = {spec.request_id for spec in recvs}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            most_locks = max(most_locks, per_peer_state_sizes(worker)[1])
            results = worker.get_transfer_results()
            recving, failed = results.finished_recving, results.failed_recving
            assert recving == failed, "a pull from a closed port cannot succeed"
            pending -= recving
            time.sleep(0.005)
        assert not pending, f"{len(pending)} pulls got no result within {RESULT_TIMEOUT_S}s"
        # The requests are no longer waiting: the next steps name no peer at all.
        ended = [waiting.request_id for waiting in beats]
        worker.start_load_kv(HixlConnectorMetadata(done_waiting=ended))
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while per_peer_state_sizes(worker) != (0, 0, 0) and time.monotonic() < deadline:
            worker.start_load_kv(HixlConnectorMetadata())
            time.sleep(0.01)
        assert per_peer_state_sizes(worker) == (0, 0, 0)
    assert 1 <= most_locks <= TRANSFER_THREADS
    stats = worker.get_stats()
    assert stats is not None
    counts = stats.reduce()
    pulls = ADDRESSES_PER_ROUND + 2
    assert counts["Num failed handshakes"] == ROUNDS * pulls, counts
    # Every heartbeat failed (none is in flight any more); the releases each failed pull sends
    # after reporting its result may still be under way.
    failed_notifications = counts["Num failed notifications"]
    assert (
        ROUNDS * ADDRESSES_PER_ROUND
        <= failed_notifications
        <= ROUNDS * (pulls + ADDRESSES_PER_ROUND)
    ), counts
