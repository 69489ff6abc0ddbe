"""A real decode HixlWorker (native engine, real sockets) shuts down within a bound under load:
reads queued behind handshakes with silent peers (listening sockets that never answer), with
a handshake timeout far longer than the bound.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.vllm_scheduler import vllm_config

with standin_helpers_importable():
    from worker_harness import decode_worker, tp_group

HANDSHAKE_TIMEOUT_S = 30.0  # far beyond the bound: shutdown must not wait it out
SHUTDOWN_BOUND_S = 5.0
SILENT_PEERS = 4
READS = 100  # more than the 64 rows of reads in flight


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hixl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hixl")]


def connected_to(ports: list[int]) -> bool:
    """Whether a TCP connection to one of ``ports`` on 127.0.0.1 is established (accepted or
    in a listener's backlog)."""
    wanted = {f"0100007F:{port:04X}" for port in ports}
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return any(row[2] in wanted and row[3] == "01" for row in rows)  # 01: ESTABLISHED


@pytest.fixture
def silent_peers() -> Iterator[list[int]]:
    """Side channels that take the connection and never answer (the kernel's backlog)."""
    sockets = [socket.socket() for _ in range(SILENT_PEERS)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
    try:
        yield [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def test_shutdown_under_load_is_bounded_and_leaves_nothing(
    tiny_model_dir: Path, silent_peers: list[int]
) -> None:
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.metadata import HixlConnectorMetadata, RecvSpec, WaitingRead

    extra = {"backend": "native", "handshake_timeout_s": HANDSHAKE_TIMEOUT_S}
    config = vllm_config(tiny_model_dir, "kv_consumer", engine_id="d-shutdown", extra=extra)
    with tp_group(config, free_port()):
        fds, threads = open_fds(), hixl_threads()
        worker, _ = decode_worker(config, "d-shutdown")
        recvs = []
        for i in range(READS):
            port = silent_peers[i % SILENT_PEERS]
            remote = RemoteEndpoint(f"silent-{port}", "127.0.0.1", port, 1, 7000 + i % 4)
            recvs.append(RecvSpec(f"d-{i}", f"p-{i}", i, remote, (i % 8,), (i % 8,)))
        beats = [
            WaitingRead(spec.request_id, spec.remote, spec.remote_request_id, spec.lease_id)
            for spec in recvs
        ]
        worker.start_load_kv(HixlConnectorMetadata(to_recv=recvs, waiting=beats))
        # Handshakes under way (a silent peer holds a connection of the worker), the rest
        # queued behind them.
        deadline = time.monotonic() + SHUTDOWN_BOUND_S
        while not connected_to(silent_peers):
            assert time.monotonic() < deadline, "no handshake with a silent peer began"
            time.sleep(0.01)
        began = time.monotonic()
        worker.shutdown()
        took = time.monotonic() - began
        assert took < SHUTDOWN_BOUND_S, f"shutdown took {took:.1f} s"
        # What a handshake under way held ends with it, within the stop poll.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and (hixl_threads() != threads or open_fds() > fds):
            time.sleep(0.05)
        assert hixl_threads() == threads
        assert open_fds() <= fds, f"{open_fds() - fds} descriptors left open"
