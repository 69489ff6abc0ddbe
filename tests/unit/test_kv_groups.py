"""kv_groups: block sizes and bytes of vLLM's KV-cache groups, and the blocks a read fills."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.kv_groups import (
    blocks_to_fill,
    group_block_sizes,
    one_group_block_bytes,
)


@dataclass(frozen=True)
class Block:
    """What kv_groups reads of vLLM's KVCacheBlock."""

    block_id: int
    block_hash: object = None
    is_null: bool = False


def group(block_size: int, page_bytes: int, layers: int) -> SimpleNamespace:
    spec = SimpleNamespace(block_size=block_size, page_size_bytes=page_bytes)
    return SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])


def test_block_sizes_per_group_or_the_cache_config() -> None:
    config = SimpleNamespace(kv_cache_groups=[group(16, 1, 1), group(32, 1, 1)])
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=64))
    assert group_block_sizes(vllm_config, config) == (16, 32)
    assert group_block_sizes(vllm_config, None) == (64,)


def test_block_bytes_only_for_one_group() -> None:
    assert one_group_block_bytes(SimpleNamespace(kv_cache_groups=[group(16, 4096, 3)])) == 12288
    two = SimpleNamespace(kv_cache_groups=[group(16, 4096, 3), group(16, 4096, 1)])
    assert one_group_block_bytes(two) == 0
    assert one_group_block_bytes(None) == 0


blocks = st.lists(
    st.tuples(st.booleans(), st.booleans()).map(
        lambda flags: (None if not flags[0] else "hash", flags[1])
    ),
    max_size=12,
)


@given(st.lists(blocks, min_size=1, max_size=3))
def test_an_asynchronous_read_fills_the_uncached_blocks_a_group_holds(
    groups: list[list[tuple[object, bool]]],
) -> None:
    made = [
        [Block(100 * g + i, h, null) for i, (h, null) in enumerate(flags)]
        for g, flags in enumerate(groups)
    ]
    filled = blocks_to_fill(made, None, 16)
    assert len(filled) == len(made)
    for (positions, ids), group_blocks in zip(filled, made, strict=True):
        wanted = [i for i, b in enumerate(group_blocks) if b.block_hash is None and not b.is_null]
        assert positions == tuple(wanted)
        assert ids == tuple(group_blocks[i].block_id for i in wanted)


@given(st.integers(0, 12), st.integers(0, 12), st.sampled_from([16, 32]))
def test_an_in_step_read_fills_every_block_past_the_local_hit(
    count: int, hit_blocks: int, block_size: int
) -> None:
    # vLLM hashes a synchronous load's blocks at once: the hashes say nothing here.
    made = [Block(i, "hash") for i in range(count)]
    ((positions, ids),) = blocks_to_fill([made], hit_blocks * block_size, block_size)
    assert positions == tuple(range(hit_blocks, count))
    assert ids == positions
