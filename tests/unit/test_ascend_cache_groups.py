"""How KV tensors map to registered caches and model_ids (reference section 8, rule 3): one
blocks cache for MHA/GQA in K0,V0,K1,V1,... order, one cache per part for MLA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import rank_address
from hixl_connector.connector.kv.layout import describe_kv_caches
from hixl_connector.connector.kv.registered_kv import register_kv, registrations
from hixl_connector.datadist.ascend import cann as ascend

NUM_BLOCKS = 8


def _mha() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, 16, 2, 32)
    return {f"layer{i}": (torch.zeros(shape), torch.zeros(shape)) for i in range(3)}


def _mla() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    latent, rope = (NUM_BLOCKS, 16, 1, 64), (NUM_BLOCKS, 16, 1, 16)
    return {
        f"layer{i}": (
            torch.zeros(latent, dtype=torch.bfloat16),
            torch.zeros(rope, dtype=torch.bfloat16),
        )
        for i in range(3)
    }


def test_mha_is_one_blocks_cache_in_k_v_order() -> None:
    kv = _mha()
    (group,) = registrations(describe_kv_caches(kv, NUM_BLOCKS))
    assert (group.model_id, group.tensors_per_layer, group.unit_bytes) == (0, 2, 16 * 2 * 32 * 4)
    expected = [t.data_ptr() for layer in kv.values() for t in layer]  # K0, V0, K1, V1, ...
    assert list(group.addrs) == expected


def test_mla_parts_are_separate_caches_with_their_own_model_ids() -> None:
    kv = _mla()
    layout = describe_kv_caches(kv, NUM_BLOCKS)
    assert layout.part_block_bytes == (16 * 64 * 2, 16 * 16 * 2)
    latent, rope = registrations(layout)
    assert (latent.model_id, rope.model_id) == (0, 1)
    assert (latent.tensors_per_layer, rope.tensors_per_layer) == (1, 1)
    assert list(latent.addrs) == [layer[0].data_ptr() for layer in kv.values()]
    assert list(rope.addrs) == [layer[1].data_ptr() for layer in kv.values()]
    # The bytes one block moves over all tensors stay exact for the statistics.
    assert layout.block_bytes * layout.num_tensors == 3 * sum(layout.part_block_bytes)


def test_mla_layers_must_agree_part_by_part() -> None:
    kv = _mla()
    kv["layer2"] = (kv["layer2"][1], kv["layer2"][0])
    with pytest.raises(ValueError, match="KV tensors differ"):
        describe_kv_caches(kv, NUM_BLOCKS)


def test_native_engine_registers_each_mla_part_under_its_own_model_id() -> None:
    kv = _mla()
    config = HixlConfig.from_dict({"backend": "native"}, "engine-mla")
    layout = describe_kv_caches(kv, NUM_BLOCKS)
    engine = register_kv(config, layout, rank_address(config, 0, 0, 1), True, False)
    try:
        assert [c.model_id for c in engine.caches] == [0, 1]
        assert [c.cache.cache_desc.num_tensors for c in engine.caches] == [3, 3]
        assert engine.max_pairs_per_pull is None  # the native engine has no request limit
    finally:
        engine.datadist.finalize()


def test_native_back_end_refuses_device_memory_with_a_clear_error() -> None:
    meta = {"layer0": torch.zeros((NUM_BLOCKS, 4), device="meta")}
    config = HixlConfig.from_dict({"backend": "native"}, "engine-meta")
    layout = describe_kv_caches(meta, NUM_BLOCKS)
    with pytest.raises(ValueError, match="moves host memory only"):
        register_kv(config, layout, rank_address(config, 0, 0, 1), True, False)


def test_ascend_back_end_refuses_a_kv_cache_in_host_memory() -> None:
    """HCCS carries no host memory and RoCE only aclrtMallocHost memory: CANN's back-end takes
    NPU memory alone (only the stand-in, which has no NPU, plays it with host memory)."""
    assert ascend.npu_memory(SimpleNamespace(type="npu"))  # torch names "npu" with torch_npu
    with pytest.raises(ValueError, match="moves a KV cache in NPU memory.*lives on cpu"):
        ascend.npu_memory(torch.device("cpu"))
    assert ascend.played_npu_memory(torch.device("cpu"))
    with pytest.raises(ValueError, match="lives on meta"):
        ascend.played_npu_memory(torch.device("meta"))
