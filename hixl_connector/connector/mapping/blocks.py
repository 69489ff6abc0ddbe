"""Pure block-id mapping: prefix-hit trimming and chunking.

Nothing here knows about vLLM, tensors or transports; every function takes and returns plain
ints so it can be checked exhaustively.
"""

from __future__ import annotations

from collections.abc import Sequence

BlockIds = tuple[int, ...]
# vLLM's null block: stands at the positions a KV-cache group does not hold (a sliding-window
# group's blocks that fell out of the window); never a block of any request.
NULL_BLOCK_ID = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (the last one may be partial)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def remote_at_positions(
    remote: Sequence[int], positions: Sequence[int], ratio: int = 1
) -> BlockIds:
    """P's blocks for the logical positions (block index within the prompt) D still has to
    fill: ``ratio`` consecutive P blocks per position when P's blocks are ``ratio`` times
    smaller than D's.

    Both sides lay a prompt out the same way, block ``i`` holding tokens ``[i*bs, (i+1)*bs)``,
    so D's block at position ``i`` takes P's blocks ``i*ratio`` to ``i*ratio + ratio - 1``.
    D's prefix-cache hits lead, so the positions are usually the tail of the prompt. Where
    the prompt ends inside D's last block, its slots past P's last block are NULL_BLOCK_ID
    (the caller checks that P offered every block of the prompt).
    """
    missing = [p for p in positions if p * ratio >= len(remote)]
    if missing:
        raise ValueError(
            f"decode side needs prompt block {missing[0]} but the prefill side offers only "
            f"{len(remote)} blocks: the remote prefill covered fewer tokens than this prompt"
        )
    slots = [s for p in positions for s in range(p * ratio, (p + 1) * ratio)]
    dropped = [s for s in slots if s < len(remote) and remote[s] == NULL_BLOCK_ID]
    if dropped:
        raise ValueError(
            f"decode side needs prompt block {dropped[0] // ratio}, which the prefill side no "
            "longer holds (out of its sliding window): the two sides' windows differ"
        )
    return tuple(remote[s] if s < len(remote) else NULL_BLOCK_ID for s in slots)


def chunk_pairs(
    src: Sequence[int], dst: Sequence[int], max_pairs: int
) -> list[tuple[BlockIds, BlockIds]]:
    """Splits the pairs into consecutive chunks of at most ``max_pairs`` pairs each.

    Source and destination are cut at the same positions so every chunk stays a valid
    pull on its own (used when a transport limits descriptors per call).
    """
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    _check_same_length(src, dst)
    return [
        (tuple(src[start : start + max_pairs]), tuple(dst[start : start + max_pairs]))
        for start in range(0, len(src), max_pairs)
    ]


def _check_same_length(src: Sequence[int], dst: Sequence[int]) -> None:
    if len(src) != len(dst):
        raise ValueError(
            f"source and destination block lists differ in length: {len(src)} != {len(dst)}"
        )
