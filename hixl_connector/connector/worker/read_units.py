"""D: what one read moves from one P rank, and the checks made before anything moves.

The KV caches are registered one unit per KV head of a block (tp_mapping), or in slices where
P's blocks are smaller (block_slices); a read names units or slices, so each P rank's heads
land straight in their slots here.
"""

from __future__ import annotations

from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.mapping.block_slices import blocks_per_block, slice_ids
from hixl_connector.connector.mapping.read_plans import ReadPlans, UnreadableRequest
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


def state_reads(
    peers: dict[int, Peer], spec: RecvSpec, tp: tuple[int, int], state: StateLayout | None
) -> list[Read]:
    """The request's state slots (state_layout): the state's units of each, from the P rank
    of this rank's index. A state is read between equal TP sizes only (a rank's state is its
    heads' and its slice of every conv sub-projection)."""
    if not spec.state_block_ids:
        return []
    rank, size = tp
    if state is None:
        raise UnreadableRequest(
            f"request {spec.remote_request_id} names state slots, and this engine's model "
            "has no state"
        )
    if spec.remote.tp_size != size:
        raise UnreadableRequest(
            f"prefill engine {spec.remote.engine_id} runs tp_size {spec.remote.tp_size}, this "
            f"engine {size}: a hybrid state model's state is read between equal TP sizes only"
        )
    src = state.slot_units((group, block) for group, block, _ in spec.state_block_ids)
    dst = state.slot_units((group, block) for group, _, block in spec.state_block_ids)
    return [(peers[rank].cluster_id, src, dst)]


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
