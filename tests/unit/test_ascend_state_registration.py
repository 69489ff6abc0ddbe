"""Where a hybrid state model's states register on the "ascend" back-end, over the
llm_datadist STAND-IN, with torch CPU tensors in vllm-ascend's planes standing in for NPU
memory (tests/ascend_standin/worker_harness.py): beside the KV, in its memory kind, from each
buffer's 2 MB-aligned first byte; and HCCS, which reads device memory from 2 MB-aligned bases
only, refuses at start the K and V that vllm-ascend lays after the conv states."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RankAddress
from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.registered_kv import register_kv
from hixl_connector.connector.kv.state_layout import state_layer_specs
from hixl_connector.tools.demo.processes import free_port

with standin_helpers_importable():
    from harness import standin_on_path
    from worker_harness import NUM_BLOCKS, hybrid_kv_cache_config, hybrid_kv_caches

CLUSTER = 220_000
FABRIC_ENV = "HIXL_STANDIN_FABRIC"


@pytest.fixture
def fabric() -> Iterator[None]:
    previous = os.environ.get(FABRIC_ENV)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FABRIC_ENV, None)
        else:
            os.environ[FABRIC_ENV] = previous


def hybrid_layout() -> KVLayout:
    """The layout of vllm-ascend's planes (worker_harness) as a worker describes it."""
    caches = hybrid_kv_caches(fill=False)
    specs = state_layer_specs(hybrid_kv_cache_config())
    return describe_kv_caches(caches, NUM_BLOCKS, groups_share_buffers=True, state_specs=specs)


def test_the_states_register_in_the_kvs_memory_kind_from_aligned_bases(fabric: None) -> None:
    from hixl_connector.connector.kv.registered_kv import STATE_MODEL_ID
    from hixl_connector.connector.kv.word_memory import ALIGNMENT_BYTES

    os.environ[FABRIC_ENV] = "roce"
    config = HixlConfig.from_dict({"backend": "ascend", "ascend_hccs": False}, "e")
    with standin_on_path():
        kv = register_kv(config, hybrid_layout(), RankAddress(CLUSTER, 0, free_port()), False, True)
        try:
            assert kv.state is not None and kv.state.model_id == STATE_MODEL_ID
            state, attention = kv.state.cache, kv.caches[0].cache
            assert state.cache_desc.placement == attention.cache_desc.placement
            assert attention.cache_desc.placement.name == "DEVICE"
            assert all(addr % ALIGNMENT_BYTES == 0 for addr in state.tensor_addrs)
        finally:
            kv.datadist.finalize()


def test_hccs_refuses_at_start_the_kv_laid_after_the_conv_states(fabric: None) -> None:
    """HCCS reads device memory from 2 MB-aligned bases only: vllm-ascend's K and V of a
    hybrid state model lie after the conv states, so registration names them and RoCE."""
    os.environ[FABRIC_ENV] = "hccs-a3"
    config = HixlConfig.from_dict({"backend": "ascend"}, "e")
    address = RankAddress(CLUSTER + 1, 0, free_port())
    with standin_on_path(), pytest.raises(ValueError) as refused:
        register_kv(config, hybrid_layout(), address, False, True)
    message = str(refused.value)
    assert "not 2 MB aligned" in message and "conv states" in message
    assert "'ascend_hccs': false" in message
