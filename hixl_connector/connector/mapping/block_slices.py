"""Pure mapping for a prefill block size smaller than decode's (P's divides D's).

A decode block of ``ratio * p`` tokens holds what ``ratio`` consecutive prefill blocks of
``p`` tokens hold, but not end to end: vLLM's CPU kernels lay a block's KV head out in an
order that depends on the block size (keys transposed, ``[head_size, block_size]``, then
values). So both sides also register their KV caches in slices of ``SLICE_ELEMENTS``
elements, and D reads, for every KV head of every block, the slices of each of P's blocks
straight into their places (``SliceRun``s, found from the kernels by ``kv.probe``).

Nothing here knows about vLLM, tensors or transports: plain ints in, plain ints out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.mapping.runs import runs_of

# vLLM's CPU kernels take block sizes in multiples of 32 tokens and move whole 32-element
# rows, so a slice of 32 elements never straddles two prefill blocks.
SLICE_ELEMENTS = 32


class BlockSizeMismatch(ValueError):
    """Prefill and decode block sizes that cannot be mapped onto each other."""


@dataclass(frozen=True)
class SliceRun:
    """``count`` slices of one unit (a KV head of a block) that stay consecutive on both
    sides: from slice ``src`` of the ``part``-th prefill block that makes up a decode block,
    to slice ``dst`` of the decode block."""

    part: int
    src: int
    dst: int
    count: int


def blocks_per_block(p_sizes: Sequence[int], d_sizes: Sequence[int]) -> int:
    """How many prefill blocks make up one decode block: 1 when every KV-cache group has
    the same block size on both sides; ``d // p`` for one group whose prefill block size is
    smaller and divides decode's. Raises BlockSizeMismatch naming both sizes otherwise."""
    if list(p_sizes) == list(d_sizes):
        return 1
    sizes = f"prefill block_size {list(p_sizes)}, decode block_size {list(d_sizes)}"
    if len(p_sizes) != 1 or len(d_sizes) != 1:
        raise BlockSizeMismatch(
            f"{sizes}: a model with several KV-cache groups needs equal block sizes"
        )
    p, d = p_sizes[0], d_sizes[0]
    if not 0 < p < d or d % p:
        raise BlockSizeMismatch(
            f"{sizes}: prefill's block size must equal decode's, or be smaller and divide it"
        )
    return d // p


def merge_runs(
    origins: Sequence[tuple[int, int]], src_unit_elements: int, ratio: int
) -> tuple[SliceRun, ...]:
    """Runs of slices that rebuild one decode unit from ``ratio`` prefill units.

    ``origins[e]`` is (part, element offset in that prefill unit) of element ``e`` of the
    decode unit. Raises ValueError unless every prefill element lands exactly once and
    slices of ``SLICE_ELEMENTS`` elements move whole."""
    if len(origins) != ratio * src_unit_elements or src_unit_elements % SLICE_ELEMENTS:
        raise ValueError(
            f"a decode unit of {len(origins)} elements cannot be {ratio} prefill units of "
            f"{src_unit_elements} elements in slices of {SLICE_ELEMENTS}"
        )
    if len(set(origins)) != len(origins) or not all(
        0 <= part < ratio and 0 <= offset < src_unit_elements for part, offset in origins
    ):
        raise ValueError("the decode block layout is not a rearrangement of prefill blocks")
    steps: list[tuple[int, int, int]] = []  # (part, its slice, the decode slice)
    for dst in range(len(origins) // SLICE_ELEMENTS):
        first = dst * SLICE_ELEMENTS
        part, offset = origins[first]
        whole = offset % SLICE_ELEMENTS == 0 and all(
            origins[first + i] == (part, offset + i) for i in range(SLICE_ELEMENTS)
        )
        if not whole:
            raise ValueError(
                f"decode elements {first}..{first + SLICE_ELEMENTS - 1} do not come from one "
                f"aligned {SLICE_ELEMENTS}-element slice of a prefill block"
            )
        steps.append((part, offset // SLICE_ELEMENTS, dst))
    return tuple(SliceRun(*run) for run in runs_of(steps))


def slice_ids(
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    runs: Sequence[SliceRun],
    ratio: int,
    src_unit: tuple[int, int, int],
    dst_unit: tuple[int, int, int],
    count: int,
) -> tuple[list[int], list[int]]:
    """Source and destination slice ids that move ``count`` KV heads of every decode block.

    ``src_blocks`` holds ``ratio`` prefill blocks per decode block of ``dst_blocks``
    (NULL_BLOCK_ID past the prompt's end: nothing is read for it). ``src_unit`` and
    ``dst_unit`` are (units per block, first unit read or written, slices per unit).
    """
    if len(src_blocks) != ratio * len(dst_blocks):
        raise ValueError(
            f"{len(src_blocks)} prefill blocks for {len(dst_blocks)} decode blocks of {ratio} each"
        )
    src_units, src_first, src_slices = src_unit
    dst_units, dst_first, dst_slices = dst_unit
    src: list[int] = []
    dst: list[int] = []
    for i, d_block in enumerate(dst_blocks):
        parts = src_blocks[i * ratio : (i + 1) * ratio]
        for head in range(count):
            d_base = (d_block * dst_units + dst_first + head) * dst_slices
            for run in runs:
                p_block = parts[run.part]
                if p_block == NULL_BLOCK_ID:
                    continue
                s_base = (p_block * src_units + src_first + head) * src_slices + run.src
                src.extend(range(s_base, s_base + run.count))
                dst.extend(range(d_base + run.dst, d_base + run.dst + run.count))
    return src, dst
