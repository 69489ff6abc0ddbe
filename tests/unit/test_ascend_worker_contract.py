"""Contract test of the "ascend" back-end: the connector's real HixlWorker on both sides (P in
its own process, D here), backend "ascend", over the llm_datadist STAND-IN
(tests/ascend_standin/), with torch CPU tensors in vllm-ascend's (k_cache, v_cache) form
standing in for NPU tensors.

It proves the connector drives only the documented LLM-DataDist API, in the documented order
(init, every cache registered, link_clusters, pull_blocks; unlink with force and relink after a
timed-out pull), and chunks long block lists under CANN's request limit. It does not prove the
NPU, HCCS or RoCE path: that needs Atlas hardware (configs/ascend/README.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loopback import has_ipv6_loopback
from standin_imports import standin_helpers_importable

with standin_helpers_importable():
    from harness import (
        launch_prefill,
        prefill_extra,
        ready,
        stop,
    )
    from worker_harness import (
        P_INCARNATION,
        decode_engine,
        decode_engine_extra,
        expected_block,
        received,
    )

P_BASE, D_BASE = 100_000, 200_000
RESULT_TIMEOUT_S = 30.0
# The keyword arguments CANN's pull_blocks reads (reference section 1, Table 1).
CANN_PULL_KEYWORDS = {"src_layer_range", "dst_layer_range", "tensor_num_per_layer"}
# P's side channel on IPv6 loopback where the host has it (its engine stays on IPv4, as CANN
# requires), so the handshake and lease messages cross IPv6 end to end.
SIDE_HOST = "::1" if has_ipv6_loopback() else "127.0.0.1"
# Pairs: more than the back-end puts in one pull_blocks request (65,406 for 4 tensors), within
# the 65,536 blocks one lease notification may name.
LONG = 65_500
LEASES: list[tuple[str, int, list[int]]] = [
    ("r-basic", 1, [5, 6, 7, 20]),
    ("r-long", 2, [5, 6] * (LONG // 2)),
    ("r-timeout", 3, [8]),
    ("r-relink", 4, [9, 10]),
    ("r-cancel", 5, [11]),
]


@pytest.fixture(scope="module")
def prefill(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, standin_fabric: str
) -> Iterator[dict[str, Any]]:
    extra = {**prefill_extra(SIDE_HOST, P_BASE), "ascend_local_comm_res": '{"version":"1.3"}'}
    side_port = extra["side_channel_port"]
    # Not waited for here: P imports vLLM while D does the same in this process.
    proc = launch_prefill(
        tiny_model_dir, "p-engine", extra, LEASES, tmp_path_factory.mktemp("prefill")
    )
    result: dict[str, Any] = {"proc": proc, "pid": proc.pid, "side_port": side_port}
    yield result
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path, prefill: dict[str, Any]) -> Iterator[dict[str, Any]]:
    extra = decode_engine_extra(D_BASE, 1.0)
    os.environ["HIXL_STANDIN_TRANSPORT"] = "tcp"  # a stopped peer then times a pull out
    try:
        with decode_engine(tiny_model_dir, "d-engine", extra) as (worker, caches, standin):
            state = {"worker": worker, "caches": caches, "standin": standin}
            ready(prefill["proc"])  # P registered and leasing
            yield state
            if not state.get("shut"):
                worker.shutdown()
    finally:
        del os.environ["HIXL_STANDIN_TRANSPORT"]


def _receive(decode: dict[str, Any], prefill: dict[str, Any], lease: int, local: list[int]) -> bool:
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.leases.guarded_read import lease_word
    from hixl_connector.connector.metadata import RecvSpec

    request, lease_id, remote_blocks = LEASES[lease]
    remote = RemoteEndpoint("p-engine", SIDE_HOST, prefill["side_port"], 1, P_BASE, P_INCARNATION)
    spec = RecvSpec(
        f"d-{request}",
        request,
        lease_id,
        remote,
        tuple(local),
        tuple(remote_blocks),
        lease_slot=lease,  # the stand-in P publishes lease k in slot k
        lease_word=lease_word(lease_id, [remote_blocks], P_INCARNATION),
    )
    return received(decode["worker"], spec, RESULT_TIMEOUT_S)


def _block(decode: dict[str, Any], tensor: int, block: int) -> set[float]:
    k_or_v = decode["caches"][f"model.layers.{tensor // 2}.self_attn.attn"][tensor % 2]
    return set(k_or_v[block].flatten().tolist())


def test_pull_lands_through_the_documented_calls(decode: Any, prefill: Any) -> None:
    assert _receive(decode, prefill, 0, [0, 1, 2, 3])
    for tensor in range(4):
        for local, remote in zip([0, 1, 2, 3], [5, 6, 7, 20], strict=True):
            assert _block(decode, tensor, local) == {expected_block(tensor, remote)}
    assert _block(decode, 0, 4) == {0.0}
    calls = decode["standin"].calls()
    # The KV cache and the scratch words D reads P's lease words into; then P's lease word,
    # the blocks, and the lease word again.
    register, pulls = ["register_blocks_cache"] * 2, ["pull_blocks"] * 3
    assert calls == ["LLMDataDist", "init", *register, "link_clusters", *pulls]


def test_long_block_list_is_chunked_under_the_request_limit(decode: Any, prefill: Any) -> None:
    before = decode["standin"].calls().count("pull_blocks")
    assert _receive(decode, prefill, 1, [30, 41] * (LONG // 2))
    assert decode["standin"].calls().count("pull_blocks") == before + 2 + 2  # and 2 lease words
    assert _block(decode, 3, 30) == {expected_block(3, 5)}
    assert _block(decode, 3, 41) == {expected_block(3, 6)}


def test_timed_out_pull_fails_then_the_link_is_rebuilt(
    decode: Any, prefill: Any, caplog: pytest.LogCaptureFixture
) -> None:
    start_calls = len(decode["standin"].calls())
    request = _submit_and_stop(decode, prefill)
    try:
        assert request is False  # reported in failed_recving, not stranded
    finally:
        os.kill(prefill["pid"], signal.SIGCONT)
    assert "LLM_TIMEOUT" in caplog.text  # the pull itself timed out (P stopped mid-read)
    assert _receive(decode, prefill, 3, [50, 51])
    assert _block(decode, 1, 51) == {expected_block(1, 10)}
    calls = decode["standin"].calls()[start_calls:]
    relink = calls.index("unlink_clusters(force)")
    assert calls[relink : relink + 3] == ["unlink_clusters(force)", "link_clusters", "pull_blocks"]


def _slowed_read(decode: Any, prefill: Any, lease: int, local: list[int], fault: Any) -> bool:
    """Reads lease ``lease`` with every stand-in pull slowed, ``fault()`` landing while the
    read's batch is in the engine; the read's outcome."""
    import threading

    outcome: list[bool] = []
    standin = decode["standin"]
    thread = threading.Thread(
        target=lambda: outcome.append(_receive(decode, prefill, lease, local))
    )
    standin.set_pull_delay(0.4)
    try:
        delayed = standin.delayed_pulls()
        thread.start()
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while standin.delayed_pulls() == delayed:  # until the batch waits in its first pull
            assert time.monotonic() < deadline, "the read never reached pull_blocks"
            time.sleep(0.005)
        fault()
        thread.join(RESULT_TIMEOUT_S)
    finally:
        standin.set_pull_delay(0.0)
    assert outcome, "the read produced no result"
    return outcome[0]


def _submit_and_stop(decode: Any, prefill: Any) -> bool:
    """The r-timeout read, P stopped while its batch is in the engine."""
    return _slowed_read(decode, prefill, 2, [60], lambda: os.kill(prefill["pid"], signal.SIGSTOP))


def test_a_request_aborted_during_its_read_is_reported_failed_and_counted(
    decode: Any, prefill: Any
) -> None:
    """Aborted while its batch is in the engine: what the batch brought is never reported
    received, the request is reported failed so vLLM frees its blocks, and it counts as
    cancelled, not as a failed read."""
    from hixl_connector.connector.metadata import HixlConnectorMetadata

    worker = decode["worker"]
    worker.get_stats()  # start counting from here
    cancel = HixlConnectorMetadata(to_cancel=["d-r-cancel"])
    assert _slowed_read(decode, prefill, 4, [62], lambda: worker.start_load_kv(cancel)) is False
    stats = worker.get_stats()
    assert stats is not None and sum(stats.data["cancelled_pulls"]) == 1
    assert not stats.data["failed_pulls"]


def test_every_pull_keyword_is_one_cann_knows(decode: Any) -> None:
    """CANN drops a keyword it does not know without a word (test_ascend_standin_rules.py), so
    the stand-in records the names it receives and none may be outside CANN's list."""
    received = decode["standin"].pull_kwargs()
    assert len(received) == decode["standin"].calls().count("pull_blocks")
    assert ("tensor_num_per_layer",) in received
    assert {name for names in received for name in names} <= CANN_PULL_KEYWORDS


def test_shutdown_unlinks_and_prefill_only_registers(decode: Any, prefill: Any) -> None:
    decode["worker"].shutdown()
    decode["shut"] = True
    calls = decode["standin"].calls()
    assert calls[-2:] == ["unlink_clusters", "finalize"]
    assert "register_blocks_cache" not in calls[4:]  # nothing registered after the first link
    out = stop(prefill["proc"])
    p_calls = json.loads(out.strip().splitlines()[-1])
    # The KV cache and the lease words.
    assert p_calls == [
        "LLMDataDist",
        "init",
        "register_blocks_cache",
        "register_blocks_cache",
        "finalize",
    ]
