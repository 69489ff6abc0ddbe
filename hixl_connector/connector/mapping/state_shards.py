"""How a hybrid state model's state divides between TP ranks, and which bytes of which P
rank's state one D rank reads when the TP sizes differ.

With vLLM's DS conv-state layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: each channel's
``kernel - 1`` values contiguous), a rank's state page holds, in order, pieces that TP
shards along one dimension each, every rank a contiguous range of each piece's items:

- Mamba2: the conv state's x (heads × head_dim channels), B and C (n_groups × state_size
  channels each; every rank holds all of them when n_groups is 1), then the ssm state
  (heads of head_dim × state_size);
- Gated DeltaNet: the conv state's Q and K (key heads × head_k channels each), V (value
  heads × head_v), then the recurrent state (value heads of head_v × head_k).

A D rank reads each of its ranges straight from the P rank that holds it, into its own
page: nothing is staged, and no byte is read twice. Under the SD layout (state_len first)
the channels of one rank interleave with the others' in every row; such a state moves
between equal TP sizes only, as one range.

Pure: no torch, no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The conv-state layout in which each rank's channels are contiguous.
CHANNELS_FIRST = "DS"
MAMBA2 = "MAMBA2"
GATED_DELTA_NET = "GDN_ATTN"


class ShardMismatch(ValueError):
    """A state that cannot be read between the two TP sizes."""


@dataclass(frozen=True)
class Shard:
    """One piece of a state layer: ``items`` of ``item_bytes`` over the whole engine, each
    rank holding an equal contiguous range of them, or all of them where ``replicated``."""

    item_bytes: int
    items: int
    replicated: bool = False

    def per_rank(self, tp: int) -> int:
        if self.replicated:
            return self.items
        if self.items % tp:
            raise ShardMismatch(f"{self.items} items do not divide between {tp} TP ranks")
        return self.items // tp

    def held(self, tp: int, rank: int) -> range:
        """The items rank ``rank`` of ``tp`` holds."""
        count = self.per_rank(tp)
        start = 0 if self.replicated else rank * count
        return range(start, start + count)


@dataclass(frozen=True)
class StateSlice:
    """``nbytes`` of P rank ``p_rank``'s state from byte ``src`` land at byte ``dst`` of this
    D rank's state."""

    p_rank: int
    src: int
    dst: int
    nbytes: int


def state_nbytes(shards: Sequence[Shard], tp: int) -> int:
    """The bytes of one rank's state."""
    return sum(shard.per_rank(tp) * shard.item_bytes for shard in shards)


def state_slices(
    shards: Sequence[Shard], p_tp: int, d_tp: int, d_rank: int
) -> tuple[StateSlice, ...]:
    """What D rank ``d_rank`` of ``d_tp`` reads of a P engine of ``p_tp``: each of its items
    from the P rank that holds it (a replicated piece from the P rank it reads its first
    sharded items from), merged into the fewest contiguous slices."""
    if not 0 <= d_rank < d_tp or p_tp < 1:
        raise ShardMismatch(f"decode rank {d_rank} of tp_size {d_tp}, prefill tp_size {p_tp}")
    source = d_rank * p_tp // d_tp
    slices: list[StateSlice] = []
    p_base = d_base = 0
    for shard in shards:
        mine = shard.held(d_tp, d_rank)
        per_p = shard.per_rank(p_tp)
        if shard.replicated:
            _append(slices, StateSlice(source, p_base, d_base, len(mine) * shard.item_bytes))
        else:
            item = mine.start
            while item < mine.stop:  # one run per P rank holding part of this rank's range
                p_rank, offset = divmod(item, per_p)
                run = min(mine.stop - item, per_p - offset)
                src = p_base + offset * shard.item_bytes
                dst = d_base + (item - mine.start) * shard.item_bytes
                _append(slices, StateSlice(p_rank, src, dst, run * shard.item_bytes))
                item += run
        p_base += per_p * shard.item_bytes
        d_base += len(mine) * shard.item_bytes
    return tuple(slices)


def _append(slices: list[StateSlice], piece: StateSlice) -> None:
    """Adds ``piece``, merged into the last slice where both continue it."""
    if slices:
        last = slices[-1]
        if (
            last.p_rank == piece.p_rank
            and last.src + last.nbytes == piece.src
            and last.dst + last.nbytes == piece.dst
        ):
            slices[-1] = StateSlice(last.p_rank, last.src, last.dst, last.nbytes + piece.nbytes)
            return
    slices.append(piece)


def granule_bytes(shards: Sequence[Shard]) -> int:
    """The largest size that divides every slice boundary at any TP pair: each piece's
    items are whole heads or groups, so a range starts at a multiple of its item's bytes."""
    return math.gcd(*(shard.item_bytes for shard in shards))


def layer_shards(
    mamba_type: str,
    conv_shape: Sequence[int],
    ssm_shape: Sequence[int],
    itemsizes: tuple[int, int],
    tp: int,
    n_groups: int | None = None,
) -> tuple[Shard, ...]:
    """The pieces of one rank's state layer, in page order, from vLLM's per-rank shapes
    (DS layout: conv ``(channels, kernel - 1)``) at TP size ``tp``. ``n_groups``: a Mamba2
    model's groups, needed only where one group per rank cannot tell 1 from ``tp``.
    Raises ShardMismatch for a state the connector cannot divide between TP sizes."""
    if mamba_type not in (MAMBA2, GATED_DELTA_NET):
        raise ShardMismatch(
            f"the connector divides Mamba2 and Gated DeltaNet states between TP sizes, not "
            f"{mamba_type}"
        )
    if len(conv_shape) != 2 or len(ssm_shape) != 3:
        raise ShardMismatch(f"{mamba_type}: conv {list(conv_shape)}, ssm {list(ssm_shape)}")
    channels, rows = conv_shape
    heads, head_a, head_b = ssm_shape
    channel = rows * itemsizes[0]
    head = head_a * head_b * itemsizes[1]
    if mamba_type == MAMBA2:  # ssm (heads, head_dim, state_size)
        x = heads * head_a
        groups, rest = divmod((channels - x) // 2, head_b)
        if rest or channels <= x or (channels - x) % 2:
            raise ShardMismatch(f"Mamba2 conv of {channels} channels beside {heads} heads")
        total = groups * tp
        if groups == 1 and tp > 1:
            if n_groups not in (1, tp):
                raise ShardMismatch(
                    f"Mamba2 with one group per rank at tp_size {tp}: n_groups {n_groups} "
                    "(the model config's) must be 1 or the tp_size"
                )
            total = tp if n_groups == tp else 1
        bc = Shard(head_b * channel, total, replicated=total == 1)
        return (Shard(head_a * channel, heads * tp), bc, bc, Shard(head, heads * tp))
    # Gated DeltaNet: recurrent state (value heads, head_v, head_k)
    values = heads * head_a
    key_heads, rest = divmod((channels - values) // 2, head_b)
    if rest or channels <= values or (channels - values) % 2:
        raise ShardMismatch(f"Gated DeltaNet conv of {channels} channels beside {values}")
    keys = Shard(head_b * channel, key_heads * tp)
    return (keys, keys, Shard(head_a * channel, heads * tp), Shard(head, heads * tp))
