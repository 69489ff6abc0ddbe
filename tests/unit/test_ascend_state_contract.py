"""Contract test of the "ascend" back-end with a hybrid state model: the connector's real
HixlWorker on both sides (P in its own process, D here) over the llm_datadist STAND-IN, with
torch CPU tensors in vllm-ascend's planes standing in for NPU memory (tests/ascend_standin/
worker_harness.py): each layer slot one 2 MB-aligned buffer of conv states, ssm states (the
attention layer's K) and V.

On every fabric the stand-in plays (HCCS on A2 and A3, RoCE), it proves that a read lands
P's blocks and state slot in D's, in all three planes, and nothing else
(test_ascend_state_registration.py: what registers where). It does not prove the NPU
path: that needs Atlas hardware (configs/ascend/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

with standin_helpers_importable():
    from harness import launch_prefill, prefill_extra, ready, stop
    from worker_harness import (
        NUM_LAYERS,
        P_INCARNATION,
        STATE_GROUP,
        attention_layer,
        decode_engine,
        decode_engine_extra,
        expected_block,
        expected_conv,
        received,
        state_layer,
    )

P_BASE, D_BASE = 110_000, 210_000
RESULT_TIMEOUT_S = 30.0
# P's attention blocks 5 and 6, its state slot 9.
LEASES: list[tuple[str, int, list[int]]] = [("r-state", 1, [5, 6])]
P_STATE_SLOT, D_STATE_SLOT = 9, 8


@pytest.fixture(scope="module")
def prefill(
    standin_fabric: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    extra = prefill_extra("127.0.0.1", P_BASE)
    directory = tmp_path_factory.mktemp("state-prefill")
    proc = launch_prefill(tiny_model_dir, "p-state", extra, LEASES, directory, state=True)
    yield {"proc": proc, "side_port": extra["side_channel_port"]}
    stop(proc)


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path, prefill: dict[str, Any]) -> Iterator[dict[str, Any]]:
    extra = decode_engine_extra(D_BASE, 5.0)
    with decode_engine(tiny_model_dir, "d-state", extra, state=True) as engine:
        worker, caches, standin = engine
        ready(prefill["proc"])  # P registered and leasing
        yield {"worker": worker, "caches": caches, "standin": standin}
        worker.shutdown()


def _receive(decode: dict[str, Any], prefill: dict[str, Any], local: list[int]) -> bool:
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.leases.guarded_read import lease_word
    from hixl_connector.connector.metadata import RecvSpec

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
    return received(decode["worker"], spec, RESULT_TIMEOUT_S)


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
    # The states' buffers (the KV in them) and the scratch words, before the link.
    assert calls[:5] == ["LLMDataDist", "init", *["register_blocks_cache"] * 2, "link_clusters"]
