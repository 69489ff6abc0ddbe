"""D: what one read moves from one P rank, and the checks made before anything moves.

The KV caches are registered one unit per KV head of a block (tp_mapping), or in slices where
P's blocks are smaller (block_slices); a read names units or slices, so each P rank's heads
land straight in their slots here.
"""

from __future__ import annotations

from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.state_layout import StateLayout, state_without_kv
from hixl_connector.connector.mapping.block_slices import blocks_per_block, slice_ids
from hixl_connector.connector.mapping.read_plans import ReadPlans, UnreadableRequest
from hixl_connector.connector.mapping.state_groups import (
    StatePart,
    block_units,
    parts_by_group,
)
from hixl_connector.connector.mapping.state_shards import ShardMismatch
from hixl_connector.connector.mapping.tp_mapping import HeadRead, unit_ids
from hixl_connector.connector.metadata import RecvSpec
from hixl_connector.connector.peers.registry import Peer
from hixl_connector.connector.worker.read_failures import LeaseError

# (peer cluster id, source ids, destination ids): one P rank's share of a request.
Read = tuple[int, list[int], list[int]]


def peer_units(
    peer: Peer, read: HeadRead, spec: RecvSpec, layout: KVLayout, plans: ReadPlans
) -> Read:
    """One P rank's heads of the request's blocks, to land straight in their slots here:
    ids of units, or of slices where P's blocks are smaller."""
    ratio = spec.blocks_per_block
    if ratio == 1:
        src = unit_ids(
            spec.remote_block_ids, peer.payload.units_per_block, read.src_head, read.count
        )
        dst = unit_ids(spec.local_block_ids, layout.units_per_block, read.dst_head, read.count)
        return peer.cluster_id, src, dst
    src, dst = slice_ids(
        spec.remote_block_ids,
        spec.local_block_ids,
        plans.slice_runs(peer.payload.block_sizes[0]),
        ratio,
        (peer.payload.units_per_block, read.src_head, layout.slices_per_unit // ratio),
        (layout.units_per_block, read.dst_head, layout.slices_per_unit),
        read.count,
    )
    return peer.cluster_id, src, dst


def kv_beside_states(peer: Peer, read: Read, spec: RecvSpec, state: StateLayout) -> Read:
    """On vllm-ascend's planes (``StateLayout.kv_parts``), one P rank's blocks of the request
    (``read``: peer_units) and the blocks here they land in, as units of the state
    registration: P's through the parts P announced, these through this engine's."""
    theirs = tuple(StatePart(*row) for row in peer.payload.kv_parts)
    if spec.blocks_per_block != 1 or not theirs:
        raise UnreadableRequest(
            f"prefill engine {peer.engine_id} and this engine place the KV beside a hybrid "
            "model's states (vllm-ascend's planes) only with one block size on both"
        )
    cluster_id, src, dst = read
    return cluster_id, block_units(theirs, src), block_units(state.kv_parts, dst)


def check_state_tp(spec: RecvSpec, state: StateLayout | None) -> None:
    """Before anything is linked: the request's state slots can be read from P's TP size
    (state_layout), and this engine has states to read them into."""
    if not spec.state_block_ids:
        return
    if state is None:
        raise UnreadableRequest(
            f"request {spec.remote_request_id} names state slots, and this engine's model "
            "has no state"
        )
    try:
        state.check_tp(spec.remote.tp_size)
    except ShardMismatch as e:
        raise UnreadableRequest(f"prefill engine {spec.remote.engine_id}: {e}") from None


def state_reads(
    readers: list[Peer], spec: RecvSpec, d_rank: int, state: StateLayout | None
) -> list[Read]:
    """The request's state slots (state_layout): the units of P's states this rank holds
    (whole between equal TP sizes, else its slices of them), from the P ranks it reads KV
    from, so they are read under those ranks' lease words. ``check_state_tp`` passed
    before anything was linked."""
    if not spec.state_block_ids:
        return []
    assert state is not None
    by_rank = {peer.payload.tp_rank: peer for peer in readers}
    placements = {str(peer.payload.state_parts) for peer in readers}
    if len(placements) != 1 or not readers[0].payload.state_parts:
        raise UnreadableRequest(
            f"prefill engine {spec.remote.engine_id} registered its states as {sorted(placements)} "
            "on its ranks; a state model's ranks place them alike"
        )
    p_parts = parts_by_group(readers[0].payload.state_parts)
    try:
        slots = state.reads(spec.state_block_ids, spec.remote.tp_size, p_parts, d_rank)
    except ValueError as e:  # ShardMismatch too
        raise UnreadableRequest(f"prefill engine {spec.remote.engine_id}: {e}") from None
    reads = []
    for p_rank, (src, dst) in sorted(slots.items()):
        if p_rank not in by_rank:
            raise UnreadableRequest(state_without_kv(p_rank, spec.remote.engine_id))
        reads.append((by_rank[p_rank].cluster_id, src, dst))
    return reads


def check_block_ids(readers: list[Peer], spec: RecvSpec) -> None:
    """Block ids beyond a P rank's cache are refused before anything is read (the words
    would refuse them too, but only after the read failed on them)."""
    states = [block for _, block, _ in spec.state_block_ids]
    highest = max((*spec.remote_block_ids, *states), default=-1)
    for peer in readers:
        if highest >= peer.payload.num_blocks:
            raise LeaseError(
                f"block id {highest} is beyond the {peer.payload.num_blocks} blocks of "
                f"prefill engine {peer.engine_id} rank {peer.payload.tp_rank}"
            )


def check_block_sizes(peer: Peer, spec: RecvSpec, block_sizes: tuple[int, ...]) -> None:
    """The block ids of the request were mapped for the block size P registered."""
    ratio = blocks_per_block(peer.payload.block_sizes, block_sizes)
    if ratio != spec.blocks_per_block:
        raise UnreadableRequest(
            f"kv_transfer_params of request {spec.remote_request_id} map "
            f"{spec.blocks_per_block} prefill blocks to a decode block, but prefill engine "
            f"{peer.engine_id} has block_size {peer.payload.block_sizes} and this engine "
            f"{list(block_sizes)}"
        )
