"""describe_kv_caches on the tensor forms vLLM hands over, and the layouts it must refuse."""

from __future__ import annotations

import pytest
import torch

from hixl_connector.connector.kv.layout import describe_kv_caches


def test_cpu_layout_layers_are_views_of_one_buffer() -> None:
    num_blocks, heads, block, head2 = 6, 2, 32, 64
    buffer = torch.zeros(3, num_blocks, heads, block, head2)
    caches = {f"layer.{i}": buffer[i] for i in range(3)}
    layout = describe_kv_caches(caches, num_blocks)
    block_bytes = heads * block * head2 * 4
    assert layout.block_bytes == block_bytes
    assert layout.tensors_per_layer == 1 and layout.num_layers == 3
    assert layout.tensor_addrs == tuple(
        buffer.data_ptr() + i * num_blocks * block_bytes for i in range(3)
    )
    assert layout.dtype == "float32" and layout.block_shape == (heads, block, head2)
    assert layout.layer_index == (("layer.0", 0), ("layer.1", 1), ("layer.2", 2))


def test_kv_split_and_tuple_forms_give_k_v_order() -> None:
    num_blocks = 4
    split = {f"l{i}": torch.zeros(2, num_blocks, 16, 8, dtype=torch.bfloat16) for i in range(2)}
    layout = describe_kv_caches(split, num_blocks)
    assert layout.tensors_per_layer == 2 and layout.num_tensors == 4
    assert layout.tensor_addrs[1] == split["l0"][1].data_ptr()
    pairs = {f"l{i}": (torch.zeros(num_blocks, 5), torch.zeros(num_blocks, 5)) for i in range(2)}
    layout = describe_kv_caches(pairs, num_blocks)
    assert layout.tensor_addrs == tuple(t.data_ptr() for p in pairs.values() for t in p)
    assert layout.block_bytes == 20


def test_blocks_of_several_kernel_blocks_are_one_block_each() -> None:
    """vllm-ascend hands a block of 256 tokens over as two of its kernels' blocks of 128."""
    num_blocks, kernel_tokens, heads, head_size = 4, 128, 2, 16
    k, v = (torch.zeros(num_blocks * 2, kernel_tokens, heads, head_size) for _ in range(2))
    layout = describe_kv_caches({"l0": (k, v)}, num_blocks)
    assert layout.num_blocks == num_blocks and layout.tensor_addrs == (k.data_ptr(), v.data_ptr())
    assert layout.block_bytes == 2 * kernel_tokens * heads * head_size * 4
    assert layout.block_shape == (2 * kernel_tokens, heads, head_size)
    with pytest.raises(ValueError, match="no block dimension of size 3"):
        describe_kv_caches({"l0": (k, v)}, 3)


@pytest.mark.parametrize(
    ("caches", "message"),
    [
        ({}, "no KV-cache tensors"),
        ({"l": torch.zeros(3, 4)}, "no block dimension of size 5"),
        ({"l": torch.zeros(10, 5).t()}, "not block-major"),
        ({"a": torch.zeros(5, 4), "b": torch.zeros(5, 8)}, "KV tensors differ"),
        (
            {"a": torch.zeros(5, 4), "b": (torch.zeros(5, 4), torch.zeros(5, 4))},
            "different numbers",
        ),
    ],
)
def test_refused_layouts(caches: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        describe_kv_caches(caches, 5)


def test_the_same_bytes_are_never_registered_twice() -> None:
    buffer = torch.zeros(5, 4)
    with pytest.raises(ValueError, match="overlap"):
        describe_kv_caches({"a": buffer, "b": buffer}, 5)


def test_head_major_blocks_register_one_unit_per_kv_head() -> None:
    num_blocks, heads, block, head2 = 6, 4, 32, 64
    buffer = torch.zeros(2, num_blocks, heads, block, head2)
    layout = describe_kv_caches({f"l{i}": buffer[i] for i in range(2)}, num_blocks, heads)
    assert layout.units_per_block == heads
    assert layout.unit_bytes == block * head2 * 4 == layout.block_bytes // heads
    # Whole blocks when heads do not split (the default), and a wrong head count is refused.
    assert describe_kv_caches({"l": buffer[0]}, num_blocks).units_per_block == 1
    with pytest.raises(ValueError, match="should hold 2 KV heads"):
        describe_kv_caches({"l": buffer[0]}, num_blocks, 2)


def test_layers_of_hybrid_groups_sharing_a_buffer_are_registered_once() -> None:
    num_blocks = 6
    buffers = torch.zeros(2, num_blocks, 2, 32, 64)
    # Gemma-3 style: sliding-window layers 0, 2 and full layers 1, 3 share buffers pairwise.
    caches = {f"l{i}": buffers[i // 2] for i in range(4)}
    layout = describe_kv_caches(caches, num_blocks, 2, groups_share_buffers=True)
    assert layout.num_tensors == 2 and layout.num_layers == 2
    assert layout.tensor_addrs == (buffers[0].data_ptr(), buffers[1].data_ptr())
    # Each layer's name finds the registered layer holding its KV.
    assert layout.layer_index == (("l0", 0), ("l1", 0), ("l2", 1), ("l3", 1))
    # The same bytes seen as another shape are not a shared buffer: refused.
    with pytest.raises(ValueError, match="overlap|differ"):
        describe_kv_caches(
            {"a": buffers[0], "b": buffers[0].view(num_blocks, 4, 16, 64)},
            num_blocks,
            groups_share_buffers=True,
        )
