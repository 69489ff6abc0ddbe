"""Reads in the step on a real pair of workers: the connector's HixlWorker on both sides, P in
its own process, D here, the native engine between them on one host (a same-host link, which
reads in place).

D's worker reports the link as read in place (what lets its scheduler choose reads in the
step), and a synchronous read lands before its step's forward even when 64 asynchronous reads
hold every row of the asynchronous ones in the same step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.vllm_scheduler import vllm_config

with standin_helpers_importable():
    from harness import launch_prefill, ready, stop
    from worker_harness import (
        NUM_BLOCKS,
        P_INCARNATION,
        decode_worker,
        expected_block,
        tp_group,
    )

P_BASE, D_BASE = 300_000, 400_000
ASYNC_READS = 64  # as many as D has rows for asynchronous reads
RESULT_TIMEOUT_S = 30.0
# Lease k leases block k + 1 of P. Lease 0 links P; leases 1..32 are each read twice,
# asynchronously, in one step (P has a lease slot per block, fewer than 64 + 2); leases 33
# and 34 are read in the step.
SHARED = ASYNC_READS // 2
LEASES = [(f"r-{k}", 1000 + k, [k + 1]) for k in range(SHARED + 3)]
assert len(LEASES) < NUM_BLOCKS


@pytest.fixture(scope="module")
def prefill(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """P's worker (native engine) leasing LEASES; yields its side-channel port."""
    side_port = free_port()
    extra = {
        "backend": "native",
        "side_channel_port": side_port,
        "cluster_id_base": P_BASE,
        "transport": "auto",
    }
    directory = tmp_path_factory.mktemp("prefill")
    proc = launch_prefill(tiny_model_dir, "p-synchronous", extra, LEASES, directory)
    try:
        ready(proc)
        yield side_port
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    extra = {"backend": "native", "cluster_id_base": D_BASE, "transport": "auto"}
    config = vllm_config(tiny_model_dir, "kv_consumer", engine_id="d-synchronous", extra=extra)
    with tp_group(config, free_port()):
        worker, caches = decode_worker(config, "d-synchronous")
        try:
            yield {"worker": worker, "caches": caches}
        finally:
            worker.shutdown()


def recv_spec(
    side_port: int, lease: int, local_block: int, synchronous: bool = False, copy: int = 0
) -> Any:
    """D's read of lease ``lease`` into ``local_block`` (``copy``: which of its reads)."""
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.leases.guarded_read import lease_word
    from hixl_connector.connector.metadata import RecvSpec

    request, lease_id, blocks = LEASES[lease]
    remote = RemoteEndpoint("p-synchronous", "127.0.0.1", side_port, 1, P_BASE, P_INCARNATION)
    return RecvSpec(
        f"d-{request}-{copy}",
        request,
        lease_id,
        remote,
        (local_block,),
        tuple(blocks),
        lease_slot=lease,  # P publishes lease k in slot k
        lease_word=lease_word(lease_id, [blocks], P_INCARNATION),
        synchronous=synchronous,
    )


def finished(worker: Any, request_ids: set[str]) -> tuple[set[str], set[str]]:
    """Collects results until every one of ``request_ids`` ended: (ended, failed)."""
    ended: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while ended < request_ids and time.monotonic() < deadline:
        results = worker.get_transfer_results()
        recving, failing = results.finished_recving, results.failed_recving
        ended |= recving
        failed |= failing
        time.sleep(0.002)
    assert ended >= request_ids, f"{len(request_ids - ended)} reads got no result"
    return ended, failed


def holds_block(caches: dict[str, Any], local_block: int, remote_block: int) -> bool:
    tensors = [tensor for pair in caches.values() for tensor in pair]
    return all(
        bool((tensor[local_block] == expected_block(index, remote_block)).all())
        for index, tensor in enumerate(tensors)
    )


def test_a_same_host_link_is_reported_in_place_and_a_synchronous_read_has_a_row_of_its_own(
    prefill: int, decode: dict[str, Any]
) -> None:
    from hixl_connector.connector.link_reports import LinkReport
    from hixl_connector.connector.metadata import HixlConnectorMetadata

    worker = decode["worker"]
    first = recv_spec(prefill, 0, local_block=1)
    worker.start_load_kv(HixlConnectorMetadata(to_recv=[first]))  # links P on the pool
    assert finished(worker, {first.request_id})[1] == set()
    assert worker.take_link_report() == LinkReport({0: {first.remote: True}})

    # Both reads of a lease land the same bytes in the same block.
    reads = [
        recv_spec(prefill, 1 + j // 2, local_block=2 + j // 2, copy=j % 2)
        for j in range(ASYNC_READS)
    ]
    synchronous = recv_spec(prefill, SHARED + 1, local_block=SHARED + 2, synchronous=True)
    # One step: every asynchronous row taken (rows come back when collected), then a read the
    # forward of this very step needs.
    worker.start_load_kv(HixlConnectorMetadata(to_recv=[*reads, synchronous]))
    assert worker.take_load_errors() == set(), "the synchronous read failed"
    assert holds_block(
        decode["caches"], synchronous.local_block_ids[0], synchronous.remote_block_ids[0]
    )
    ended, failed = finished(worker, {spec.request_id for spec in reads})
    assert failed == set()
    assert synchronous.request_id not in ended  # vLLM learns of it from the forward, not here
    for spec in reads:
        assert holds_block(decode["caches"], spec.local_block_ids[0], spec.remote_block_ids[0])
    stats = worker.get_stats()
    assert stats is not None and stats.reduce()["Num sync loads"] == 1


def test_a_synchronous_read_from_a_link_just_dropped_reads_and_the_step_never_handshakes(
    prefill: int, decode: dict[str, Any]
) -> None:
    """Another request's failure dropped P's rank (the scheduler learns of it a step
    later): a synchronous read still reads over the same-host link, which reads or fails at
    once, instead of failing for a transient state or handshaking on the step thread."""
    from hixl_connector.connector.metadata import HixlConnectorMetadata

    worker = decode["worker"]
    spec = recv_spec(prefill, SHARED + 2, local_block=SHARED + 3, synchronous=True)
    target = spec.remote.rank(0)
    peer = worker._decode.peers.in_place(target)
    assert peer is not None, "linked by the test before"
    worker._decode.peers.drop(peer)
    began = time.monotonic()
    worker.start_load_kv(HixlConnectorMetadata(to_recv=[spec]))
    took = time.monotonic() - began
    assert worker.take_load_errors() == set()
    assert holds_block(decode["caches"], spec.local_block_ids[0], spec.remote_block_ids[0])
    assert worker._decode.peers.in_place(target) is peer, "the step thread handshook again"
    assert took < 0.5, f"the step waited {took:.2f} s"
