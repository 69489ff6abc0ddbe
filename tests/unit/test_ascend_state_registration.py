"""What a hybrid state model registers on the "ascend" back-end in vllm-ascend's planes, over
the llm_datadist STAND-IN on each fabric it plays, with torch CPU tensors standing in for NPU
memory (tests/ascend_standin/worker_harness.py): each buffer once, from its 2 MB-aligned first
byte, in the KV's memory kind, the KV read through it; K and V, which lie after the conv
states off HCCS's 2 MB alignment, are not registered on their own."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RankAddress
from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.registered_kv import STATE_MODEL_ID, register_kv
from hixl_connector.connector.kv.state_layout import state_layer_specs
from hixl_connector.connector.kv.word_memory import ALIGNMENT_BYTES
from hixl_connector.tools.demo.processes import free_port

with standin_helpers_importable():
    from harness import standin_on_path
    from worker_harness import (
        NUM_BLOCKS,
        STATE_CONV,
        STATE_SSM,
        hybrid_kv_cache_config,
        hybrid_kv_caches,
    )

CLUSTER = 220_000


@pytest.fixture(scope="module")
def standin(standin_fabric: str) -> Iterator[Any]:
    with standin_on_path() as llm_datadist:
        yield llm_datadist


def hybrid_layout() -> KVLayout:
    """The layout of vllm-ascend's planes (worker_harness) as a worker describes it."""
    caches = hybrid_kv_caches(fill=False)
    specs = state_layer_specs(hybrid_kv_cache_config())
    return describe_kv_caches(caches, NUM_BLOCKS, groups_share_buffers=True, state_specs=specs)


def test_each_buffer_registers_once_from_its_aligned_first_byte_on_the_device(
    standin: Any,
) -> None:
    layout = hybrid_layout()
    assert layout.state is not None and layout.kv_in_states_buffers
    # K and V of a layer lie after its conv states: not where HCCS reads from.
    assert any(addr % ALIGNMENT_BYTES for addr in layout.tensor_addrs)
    config = HixlConfig.from_dict({"backend": "ascend"}, "e")
    kv = register_kv(config, layout, RankAddress(CLUSTER, 0, free_port()), False, True)
    try:
        assert kv.caches == ()  # no registration of K and V on their own
        assert kv.state is not None and kv.state.model_id == STATE_MODEL_ID
        cache = kv.state.cache
        assert cache.tensor_addrs == list(layout.state.regions)
        assert all(addr % ALIGNMENT_BYTES == 0 for addr in cache.tensor_addrs)
        assert cache.cache_desc.placement.name == "DEVICE"
        # Every byte of each buffer: conv states, ssm states (K) and V.
        units, unit_bytes = cache.cache_desc.shape
        page = (math.prod(STATE_CONV) + 2 * math.prod(STATE_SSM)) * 4  # fp32
        assert units * unit_bytes == NUM_BLOCKS * page
    finally:
        kv.datadist.finalize()


def test_push_mode_is_refused_for_a_kv_beside_the_states(standin: Any) -> None:
    config = HixlConfig.from_dict({"backend": "ascend", "transfer_mode": "push"}, "e")
    address = RankAddress(CLUSTER + 1, 0, free_port())
    with pytest.raises(ValueError, match="planes beside a hybrid model's states.*'pull'"):
        register_kv(config, hybrid_layout(), address, False, True)
