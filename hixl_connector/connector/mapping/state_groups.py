"""What the connector knows of vLLM's per-request state groups: the KV-cache groups of a
hybrid state model (``MambaSpec``: Mamba2, Gated DeltaNet, short convolutions) that hold one
running state per request rather than a block per tokens.

- P computes the prompt but its last token and D loads that many tokens, then computes the
  last one itself (``tokens_to_load``): P's state after the whole prompt would already hold
  the last token, which D must compute again for its logits. NixlConnector does the same, so
  routers, proxies and mixed fleets agree.
- A state group's block table is not a list of token blocks: the running state sits in one
  slot (``state_slot``), beside speculative scratch slots or null placeholders that are never
  read or written.
- A state block lies in parts (``StatePart``): on vLLM's pages, a layer's conv state, then
  its ssm state, then padding up to the attention page; on vllm-ascend's planes, all blocks'
  conv states, then all their ssm states. Only the state's bytes move (``state_bytes``).

Pure: no torch, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STATE_SPEC = "MambaSpec"
# mamba_cache_mode: "none" keeps one state slot per request (no prefix caching); "align"
# keeps a state per block of tokens, the running one at the block of the last token.
NO_STATE_CACHE = "none"
ALIGNED_STATE_CACHE = "align"


def is_state_spec(spec: Any) -> bool:
    """Whether a KV-cache spec holds per-request state (by class name: the scheduler half
    imports nothing of vLLM's torch side)."""
    return any(cls.__name__ == STATE_SPEC for cls in type(spec).__mro__)


@dataclass(frozen=True)
class StateGroups:
    """The state groups of a model's KV-cache config (none for a model of attention only)."""

    indices: tuple[int, ...] = ()
    cache_mode: str = NO_STATE_CACHE
    speculative_blocks: int = 0

    def __bool__(self) -> bool:
        return bool(self.indices)

    def __contains__(self, group: object) -> bool:
        return group in self.indices


def state_groups(kv_cache_config: Any) -> StateGroups:
    """The state groups of ``kv_cache_config``, with their cache mode and scratch slots
    (every state group of a model shares them)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    specs = [(i, g.kv_cache_spec) for i, g in enumerate(groups) if is_state_spec(g.kv_cache_spec)]
    if not specs:
        return StateGroups()
    modes = {str(getattr(spec, "mamba_cache_mode", NO_STATE_CACHE)) for _, spec in specs}
    scratch = {int(getattr(spec, "num_speculative_blocks", 0)) for _, spec in specs}
    if len(modes) != 1 or len(scratch) != 1:
        raise ValueError(
            f"the state groups of this model differ in mamba_cache_mode ({sorted(modes)}) or "
            f"speculative slots ({sorted(scratch)}); the connector expects one of each"
        )
    return StateGroups(tuple(i for i, _ in specs), modes.pop(), scratch.pop())


# A model of attention only.
NO_STATE = StateGroups()


def tokens_to_load(num_prompt_tokens: int, has_state: bool) -> int:
    """The prompt tokens P computes for D and D loads: all of an attention model's (vLLM
    computes the last one again anyway); all but the last of a state model's, whose state
    must not hold the token D computes again. A one-token prompt of a state model loads
    nothing: D computes it."""
    if num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
    return num_prompt_tokens - 1 if has_state and num_prompt_tokens > 0 else num_prompt_tokens


def state_slot(row_length: int, num_tokens: int, block_size: int, groups: StateGroups) -> int:
    """The position, in a request's row of a state group, of the slot that holds the state
    after ``num_tokens`` tokens: the first slot without prefix caching (speculative scratch
    slots follow it), else the slot of the block of the last token (null placeholders lead
    it). Raises ValueError when the row has no such slot."""
    if num_tokens < 1:
        raise ValueError(f"no state after {num_tokens} tokens")
    if groups.cache_mode == NO_STATE_CACHE:
        position = 0
    elif groups.cache_mode == ALIGNED_STATE_CACHE:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        position = math.ceil(num_tokens / block_size) - 1
    else:
        raise ValueError(f"mamba_cache_mode {groups.cache_mode!r} is not one the connector reads")
    if position >= row_length - groups.speculative_blocks:
        raise ValueError(
            f"a state row of {row_length} slots ({groups.speculative_blocks} of them scratch) "
            f"has no state slot for {num_tokens} tokens at position {position}"
        )
    return position


@dataclass(frozen=True)
class StateBytes:
    """The bytes of one state layer's parts: the conv state, then the ssm state (none for
    short convolutions)."""

    parts: tuple[int, ...]  # bytes of each part, in MambaSpec.shapes order

    @property
    def nbytes(self) -> int:
        return sum(self.parts)


def state_bytes(shapes: Sequence[Sequence[int]], dtype_sizes: Sequence[int]) -> StateBytes:
    """A state layer's parts (``MambaSpec.shapes``, the sizes of its ``dtypes``)."""
    if len(shapes) != len(dtype_sizes) or not shapes:
        raise ValueError(f"state shapes {list(shapes)} and dtype sizes {list(dtype_sizes)}")
    sizes = zip(shapes, dtype_sizes, strict=True)
    return StateBytes(tuple(math.prod(shape) * size for shape, size in sizes))


@dataclass(frozen=True)
class StatePart:
    """Where one part of a state group's states lies in the state registration, in units:
    block b's part is units ``[first + b * stride, first + b * stride + length)``. A state is
    its parts in order: one part where a block's state is contiguous (vLLM's pages), a part
    per plane where all blocks' conv states lie before all their ssm states (vllm-ascend)."""

    first: int
    stride: int
    length: int


def block_units(parts: Sequence[StatePart], blocks: Sequence[int]) -> list[int]:
    """The units of ``blocks``, each whole (all its parts, in order), one block after another."""
    length = state_length(parts)
    return [unit for block in blocks for unit in placed_units(parts, block, 0, length)]


def parts_by_group(rows: Sequence[Sequence[int]]) -> dict[int, tuple[StatePart, ...]]:
    """Each state group's parts, from [group, first, stride, length] rows in state order
    (the handshake's ``state_parts``)."""
    parts: dict[int, tuple[StatePart, ...]] = {}
    for group, first, stride, length in rows:
        parts[group] = (*parts.get(group, ()), StatePart(first, stride, length))
    return parts


def state_length(parts: Sequence[StatePart]) -> int:
    """The units of one block's state."""
    return sum(part.length for part in parts)


def placed_runs(
    parts: Sequence[StatePart], block: int, start: int, count: int
) -> list[tuple[int, int]]:
    """Where units ``[start, start + count)`` of block ``block``'s state (counted from the
    state's start) lie in the registration: runs of (first unit, count), one per part they
    touch, in state order."""
    if block < 0 or start < 0 or count < 1 or start + count > state_length(parts):
        raise ValueError(
            f"units {start} to {start + count} of block {block}'s state of "
            f"{state_length(parts)} units"
        )
    runs = []
    offset = 0
    for part in parts:
        low, high = max(start, offset), min(start + count, offset + part.length)
        if low < high:
            runs.append((part.first + block * part.stride + low - offset, high - low))
        offset += part.length
    return runs


def placed_units(parts: Sequence[StatePart], block: int, start: int, count: int) -> list[int]:
    """The units ``placed_runs`` names, one by one."""
    runs = placed_runs(parts, block, start, count)
    return [unit for first, n in runs for unit in range(first, first + n)]
