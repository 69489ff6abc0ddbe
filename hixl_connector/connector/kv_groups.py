"""What the scheduler half knows of vLLM's KV-cache groups: their block sizes, the bytes of
a block, and which of a request's blocks a read must fill. Pure: no torch, no engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# (positions, block ids) of one group's blocks to fill; a position is the block's index
# within the request.
Unfilled = tuple[tuple[int, ...], tuple[int, ...]]


def group_block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, ...]:
    """Tokens per block of each KV-cache group (hybrid models have several groups)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return tuple(int(group.kv_cache_spec.block_size) for group in groups) or (
        int(vllm_config.cache_config.block_size),
    )


def one_group_block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block on this rank, every layer together, for a model with one
    KV-cache group; 0 otherwise (and without a KV-cache config)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return 0
    return int(groups[0].kv_cache_spec.page_size_bytes) * len(groups[0].layer_names)


def blocks_to_fill(
    groups: Sequence[Sequence[Any]], local_hit: int | None, block_size: int
) -> list[Unfilled]:
    """Each group's blocks of a request that its read fills. An asynchronous load
    (``local_hit`` None) fills the blocks vLLM has not cached; vLLM caches a synchronous
    load's blocks at once, so one (of a single group) fills those past the ``local_hit``
    tokens of the local prefix cache."""
    if local_hit is None:
        return [_uncached(group) for group in groups]
    (group,) = groups
    positions = tuple(range(local_hit // block_size, len(group)))
    return [(positions, tuple(group[p].block_id for p in positions))]


def _uncached(group: Sequence[Any]) -> Unfilled:
    """The blocks the local prefix cache did not fill (and that the group holds at all: a
    sliding window's dropped blocks are null)."""
    unfilled = [
        (position, block.block_id)
        for position, block in enumerate(group)
        if block.block_hash is None and not block.is_null
    ]
    return tuple(p for p, _ in unfilled), tuple(b for _, b in unfilled)
