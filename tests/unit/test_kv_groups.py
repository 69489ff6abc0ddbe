"""kv_groups: block sizes and bytes of vLLM's KV-cache groups, and the blocks a read fills."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.kv_groups import (
    blocks_to_fill,
    check_every_layer_registered,
    check_movable,
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


@given(st.lists(blocks, min_size=1, max_size=3), st.integers(0, 12 * 16))
def test_an_asynchronous_read_fills_the_uncached_prompt_blocks_a_group_holds(
    groups: list[list[tuple[object, bool]]], prompt_tokens: int
) -> None:
    made = [
        [Block(100 * g + i, h, null) for i, (h, null) in enumerate(flags)]
        for g, flags in enumerate(groups)
    ]
    filled = blocks_to_fill(made, None, [16] * len(made), prompt_tokens)
    assert len(filled) == len(made)
    prompt_blocks = -(-prompt_tokens // 16)
    for (positions, ids), group_blocks in zip(filled, made, strict=True):
        wanted = [
            i
            for i, b in enumerate(group_blocks)
            if b.block_hash is None and not b.is_null and i < prompt_blocks
        ]
        assert positions == tuple(wanted)
        assert ids == tuple(group_blocks[i].block_id for i in wanted)


@given(st.integers(0, 12), st.integers(0, 12), st.integers(1, 12 * 32), st.sampled_from([16, 32]))
def test_a_synchronous_read_fills_every_prompt_block_past_the_local_hit(
    count: int, hit_blocks: int, prompt_tokens: int, block_size: int
) -> None:
    # vLLM hashes a synchronous load's blocks at once: the hashes say nothing here.
    made = [Block(i, "hash") for i in range(count)]
    ((positions, ids),) = blocks_to_fill(
        [made], hit_blocks * block_size, [block_size], prompt_tokens
    )
    prompt_blocks = -(-prompt_tokens // block_size)
    assert positions == tuple(range(hit_blocks, min(count, prompt_blocks)))
    assert ids == positions


def test_lookahead_slots_of_a_speculative_decoder_are_not_read() -> None:
    """A 64-token prompt in 32-token blocks, loaded in the step with 3 lookahead tokens:
    vLLM allocates a third block for them, which P never computed and never offers."""
    hashed = [Block(7, "hash"), Block(8, "hash"), Block(9, "hash")]
    assert blocks_to_fill([hashed], 0, [32], 64) == [((0, 1), (7, 8))]
    unhashed = [Block(7), Block(8), Block(9)]
    assert blocks_to_fill([unhashed], None, [32], 64) == [((0, 1), (7, 8))]


def test_attention_kv_and_state_move_and_anything_else_is_refused_naming_it() -> None:
    """vLLM's own spec classes: attention KV of every kind and a state group (pull mode, with
    or without prefix caching of the state) move; a state mixed into an attention group, a
    cache mode the connector does not know, push mode with state and a spec of another kind
    are refused at start, naming what to change."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64
    )
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    aligned = MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )

    def config(*specs: Any) -> KVCacheConfig:
        groups = [
            KVCacheGroupSpec([f"layers.{i}.{j}" for j in range(4)], spec)
            for i, spec in enumerate(specs)
        ]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "b": full})
    movable = (config(full), config(full, window), config(mla), config(uniform))
    for model in (*movable, config(full, mamba), config(full, mamba, mamba)):
        check_movable(model)
    check_movable(None)  # no KV-cache config: nothing to refuse
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "m": mamba})
    with pytest.raises(ValueError, match=r"group 0 of this model holds MambaSpec \(layers.0.0, "):
        check_movable(config(mixed))
    check_movable(config(full, aligned))  # prefix caching of the state
    unknown_mode = MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="all"
    )
    with pytest.raises(ValueError, match="mamba_cache_mode 'all', which hixl_connector does"):
        check_movable(config(full, unknown_mode))

    class Unknown(KVCacheSpec):  # a spec of a kind the connector does not know
        pass

    unknown = Unknown(block_size=16)
    with pytest.raises(ValueError, match=r"group 1 of this model holds Unknown \(layers.1.0, "):
        check_movable(config(full, unknown))


def test_a_layer_vllm_did_not_register_with_the_connector_is_refused() -> None:
    """Every layer of vLLM's KV-cache config must be among those registered, else its KV
    would silently never move (a speculative draft's, say); groups vLLM rebuilds itself
    (enable_kv_transfer False) are exempt."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    target = KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(2)], full)
    draft = KVCacheGroupSpec(["draft.layers.0.attn"], full, is_eagle_group=True)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[target, draft])
    every = [*target.layer_names, *draft.layer_names]
    check_every_layer_registered(config, every)
    check_every_layer_registered(None, [])
    with pytest.raises(ValueError, match=r"group 1 \(the speculative draft's\) has 1 layer.*"):
        check_every_layer_registered(config, target.layer_names)
    with pytest.raises(ValueError, match="group 0 has 1 layer.*model.layers.1.attn"):
        check_every_layer_registered(config, [every[0], every[2]])
    rebuilt = KVCacheGroupSpec(["draft.layers.0.attn"], full, enable_kv_transfer=False)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[target, rebuilt])
    check_every_layer_registered(config, target.layer_names)
