"""Pure tensor-parallel mapping: which P ranks a D rank reads, and which KV heads land where.

vLLM shards the KV heads of a layer over the TP ranks in order: with ``H`` KV heads and TP
size ``t``, rank ``r`` holds heads ``[r*H/t, (r+1)*H/t)`` when ``t <= H``; when ``t > H``
every head is replicated on ``t/H`` consecutive ranks, and rank ``r`` holds head ``r*H/t``
(one head). MLA-style caches (``replicated=True``) hold the same latent on every rank.

The decode side does all the reshaping. A D rank reads each of its heads exactly once, from
one P rank that holds it (replicas are spread over the D ranks that share a head), so no
byte is read twice and nothing is staged. Every P rank must hear "done" from every D rank
that read it before it frees; a P rank nobody reads (a replica) hears from one designated
D rank instead, so every P rank's lease ends without waiting for expiry.

Nothing here knows about vLLM, tensors or transports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hixl_connector.connector.mapping.runs import runs_of


@dataclass(frozen=True)
class HeadRead:
    """Heads ``[src_head, src_head + count)`` of P rank ``p_rank``'s blocks land at
    ``[dst_head, dst_head + count)`` of this D rank's blocks (indices local to each rank)."""

    p_rank: int
    src_head: int
    dst_head: int
    count: int


@dataclass(frozen=True)
class RankPlan:
    """What one D rank does for every request from a P engine of a given TP size.

    ``reads``: the head slices it pulls, grouped by P rank in ascending order.
    ``notify``: every P rank it sends "done"/"release" to (those it reads, and the unread
    replicas it is designated for), ascending. ``consumers[p]``: how many distinct D ranks
    notify P rank ``p``; P frees once it heard from that many.
    """

    reads: tuple[HeadRead, ...]
    notify: tuple[int, ...]
    consumers: dict[int, int]

    def reads_from(self, p_rank: int) -> tuple[HeadRead, ...]:
        return tuple(read for read in self.reads if read.p_rank == p_rank)


class TPMismatch(ValueError):
    """The two TP sizes (or the head count) cannot be mapped onto each other."""


def check_tp_pair(num_kv_heads: int, p_tp: int, d_tp: int, replicated: bool = False) -> None:
    """Raises TPMismatch unless every D rank's heads can be read from P's ranks."""
    for name, value in (("num_kv_heads", num_kv_heads), ("P tp_size", p_tp), ("D tp_size", d_tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TPMismatch(f"{name} must be an int >= 1, got {value!r}")
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise TPMismatch(
            f"prefill tp_size={p_tp} and decode tp_size={d_tp}: the larger must be a multiple "
            "of the smaller"
        )
    if replicated:
        return
    for side, tp in (("prefill", p_tp), ("decode", d_tp)):
        if tp <= num_kv_heads and num_kv_heads % tp:
            raise TPMismatch(f"{side} tp_size={tp} does not divide num_kv_heads={num_kv_heads}")
        if tp > num_kv_heads and tp % num_kv_heads:
            raise TPMismatch(
                f"{side} tp_size={tp} exceeds num_kv_heads={num_kv_heads} and is not a "
                "multiple of it"
            )


def check_shardable(kv_split: str, kv_layout: str, num_kv_heads: int, p_tp: int, d_tp: int) -> None:
    """Raises TPMismatch unless a D rank of TP ``d_tp`` can read a P engine of TP ``p_tp``:
    ``kv_split`` "heads" and "replicated" map any valid pair, "none" (heads interleaved
    inside a block, the layout named ``kv_layout``) only equal sizes."""
    if p_tp != d_tp and kv_split == "none":
        raise TPMismatch(
            f"prefill tp_size={p_tp} and decode tp_size={d_tp} differ, but the KV layout "
            f"{kv_layout!r} interleaves KV heads inside a block (kv_split 'none'); run equal "
            "TP sizes on this platform"
        )
    check_tp_pair(num_kv_heads, p_tp, d_tp, replicated=kv_split == "replicated")


def heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds (1 when heads are replicated over ranks)."""
    return max(1, num_kv_heads // tp)


def first_head(num_kv_heads: int, tp: int, rank: int) -> int:
    """Global index of the first KV head rank ``rank`` holds."""
    if tp <= num_kv_heads:
        return rank * (num_kv_heads // tp)
    return rank // (tp // num_kv_heads)


def plan_rank(
    num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, replicated: bool = False
) -> RankPlan:
    """The reads and notifications of D rank ``d_rank``; raises TPMismatch."""
    check_tp_pair(num_kv_heads, p_tp, d_tp, replicated)
    if not 0 <= d_rank < d_tp:
        raise TPMismatch(f"decode tp_rank {d_rank} is out of range for tp_size {d_tp}")
    reads_by_rank = [_reads(num_kv_heads, p_tp, d_tp, d, replicated) for d in range(d_tp)]
    notified_by: dict[int, set[int]] = {p: set() for p in range(p_tp)}
    for d, reads in enumerate(reads_by_rank):
        for read in reads:
            notified_by[read.p_rank].add(d)
    for p, ranks in notified_by.items():
        if not ranks:  # an unread replica: one D rank tells it to free
            ranks.add(p % d_tp)
    notify = tuple(p for p in range(p_tp) if d_rank in notified_by[p])
    consumers = {p: len(notified_by[p]) for p in notify}
    return RankPlan(reads_by_rank[d_rank], notify, consumers)


def _reads(
    num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int, replicated: bool
) -> tuple[HeadRead, ...]:
    if replicated:  # every P rank holds everything: spread the D ranks over them
        return (HeadRead(d_rank % p_tp, 0, 0, 1),)
    d_first = first_head(num_kv_heads, d_tp, d_rank)
    p_heads = heads_per_rank(num_kv_heads, p_tp)
    p_replicas = max(1, p_tp // num_kv_heads)
    d_replicas = max(1, d_tp // num_kv_heads)
    steps: list[tuple[int, int, int]] = []  # (P rank, its head, this rank's head)
    for offset in range(heads_per_rank(num_kv_heads, d_tp)):
        head = d_first + offset
        if p_tp <= num_kv_heads:
            p_rank = head // p_heads
        else:  # replicas of this head sit on p_replicas consecutive P ranks
            p_rank = head * p_replicas + (d_rank % d_replicas) % p_replicas
        steps.append((p_rank, head - first_head(num_kv_heads, p_tp, p_rank), offset))
    return tuple(HeadRead(*run) for run in runs_of(steps))


def unit_ids(block_ids: Sequence[int], units_per_block: int, first: int, count: int) -> list[int]:
    """Ids of units ``[first, first + count)`` of each block, when every block is registered
    as ``units_per_block`` consecutive units (a unit: one KV head of one block)."""
    return [b * units_per_block + first + i for b in block_ids for i in range(count)]
