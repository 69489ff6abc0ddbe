"""Contract test of the "ascend" back-end with a hybrid state model: the connector's real
HixlWorker on both sides (P in its own process, D here) over the llm_datadist STAND-IN, with
torch CPU tensors in vllm-ascend's planes standing in for NPU memory (tests/ascend_standin/
worker_harness.py): each layer slot one 2 MB-aligned buffer of conv states, ssm states (the
attention layer's K) and V.

It proves that a read lands P's state slot in D's, in both planes, and nothing else
(test_ascend_state_registration.py: where the states register). It does not prove the NPU
path: that needs Atlas hardware (configs/ascend/README.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.vllm_scheduler import vllm_config

with standin_helpers_importable():
    from harness import launch_prefill, ready, standin_on_path, stop
    from worker_harness import (
        NUM_LAYERS,
        P_INCARNATION,
        STATE_GROUP,
        attention_layer,
        decode_worker,
        expected_block,
        expected_conv,
        state_layer,
        tp_group,
    )

P_BASE, D_BASE = 110_000, 210_000
RESULT_TIMEOUT_S = 30.0
FABRIC_ENV = "HIXL_STANDIN_FABRIC"
# Over RoCE, where device memory needs no alignment: P's attention blocks 5 and 6, its state
# slot 9.
LEASES: list[tuple[str, int, list[int]]] = [("r-state", 1, [5, 6])]
P_STATE_SLOT, D_STATE_SLOT = 9, 8
ROCE = {"backend": "ascend", "ascend_hccs": False}


@pytest.fixture(scope="module")
def roce() -> Iterator[None]:
    previous = os.environ.get(FABRIC_ENV)
    os.environ[FABRIC_ENV] = "roce"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[FABRIC_ENV]
        else:
            os.environ[FABRIC_ENV] = previous


@pytest.fixture(scope="module")
def prefill(
    roce: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    side_port, engine_port = free_port(), free_port()
    extra = {
        **ROCE,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": side_port,
        "engine_host": "127.0.0.1",
        "engine_port": engine_port,
        "cluster_id_base": P_BASE,
    }
    directory = tmp_path_factory.mktemp("state-prefill")
    proc = launch_prefill(tiny_model_dir, "p-state", extra, LEASES, directory, state=True)
    yield {"proc": proc, "side_port": side_port}
    stop(proc)


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path, prefill: dict[str, Any]) -> Iterator[dict[str, Any]]:
    extra = {
        **ROCE,
        "cluster_id_base": D_BASE,
        "engine_port": free_port(),
        "pull_timeout_s": 5.0,
        "handshake_timeout_s": 5.0,
    }
    config = vllm_config(
        tiny_model_dir, "kv_consumer", engine_id="d-state", extra=extra, state="none"
    )
    with standin_on_path() as standin, tp_group(config, free_port()):
        worker, caches = decode_worker(config, "d-state", state=True)
        ready(prefill["proc"])  # P registered and leasing
        yield {"worker": worker, "caches": caches, "standin": standin}
        worker.shutdown()


def _receive(decode: dict[str, Any], prefill: dict[str, Any], local: list[int]) -> bool:
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.leases.guarded_read import lease_word
    from hixl_connector.connector.metadata import HixlConnectorMetadata, RecvSpec

    request, lease_id, remote_blocks = LEASES[0]
    remote = RemoteEndpoint("p-state", "127.0.0.1", prefill["side_port"], 1, P_BASE, P_INCARNATION)
    spec = RecvSpec(
        f"d-{request}",
        request,
        lease_id,
        remote,
        tuple(local),
        tuple(remote_blocks),
        lease_slot=0,  # the stand-in P publishes lease k in slot k
        lease_word=lease_word(lease_id, [remote_blocks], P_INCARNATION),
        state_block_ids=((STATE_GROUP, P_STATE_SLOT, D_STATE_SLOT),),
    )
    worker = decode["worker"]
    worker.start_load_kv(HixlConnectorMetadata(to_recv=[spec]))
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        results = worker.get_transfer_results()
        if spec.request_id in results.finished_recving:
            return spec.request_id not in results.failed_recving
        time.sleep(0.02)
    raise AssertionError(f"no result for {spec.request_id} within {RESULT_TIMEOUT_S}s")


def test_a_read_lands_ps_state_slot_in_ds_planes_and_nothing_else(
    decode: dict[str, Any], prefill: dict[str, Any]
) -> None:
    caches = decode["caches"]
    assert _receive(decode, prefill, [0, 1])
    for layer in range(NUM_LAYERS):
        k, v = caches[attention_layer(layer)]
        conv, ssm = caches[state_layer(layer)]
        for local, remote in ((0, 5), (1, 6)):
            assert set(k[local].flatten().tolist()) == {expected_block(2 * layer, remote)}
            assert set(v[local].flatten().tolist()) == {expected_block(2 * layer + 1, remote)}
        # P's state slot: its conv state, and its ssm state (on P, its K block's values).
        assert set(conv[D_STATE_SLOT].flatten().tolist()) == {expected_conv(layer, P_STATE_SLOT)}
        assert set(ssm[D_STATE_SLOT].flatten().tolist()) == {
            expected_block(2 * layer, P_STATE_SLOT)
        }
        # Nothing else: no other conv state, no V of the state slot, no other block.
        others = [b for b in range(conv.shape[0]) if b != D_STATE_SLOT]
        assert set(conv[others].flatten().tolist()) == {0.0}
        assert set(v[D_STATE_SLOT].flatten().tolist()) == {0.0}
        assert set(k[2:D_STATE_SLOT].flatten().tolist()) == {0.0}
    calls = decode["standin"].calls()
    # The KV, the states and the scratch words, registered in that order before the link.
    assert calls[:5] == ["LLMDataDist", "init", *["register_blocks_cache"] * 3]
