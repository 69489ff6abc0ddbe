"""D side: whether a prefill rank's handshake lets this decode rank read it.

Pure: the handshake's answer against what the request's params name and this rank's own
announcement; nothing is linked here.
"""

from __future__ import annotations

from hixl_connector.connector.endpoints import PeerRank
from hixl_connector.connector.mapping.block_slices import BlockSizeMismatch, blocks_per_block
from hixl_connector.connector.mapping.tp_mapping import heads_per_rank
from hixl_connector.connector.peers.handshake import HandshakePayload, describe_mismatch


class PeerError(RuntimeError):
    """The peer cannot be used: handshake refused, incompatible, or link failed."""


def check_compatible(target: PeerRank, payload: HandshakePayload, local: HandshakePayload) -> None:
    """Raises PeerError unless ``payload`` (P's handshake) is the engine rank ``target``
    names, at the start its params come from, and can be read by ``local`` (this D rank)."""
    remote = target.remote
    if payload.engine_id != remote.engine_id:
        raise PeerError(
            f"side channel {remote.host}:{target.port} serves engine {payload.engine_id}, "
            f"the request expects {remote.engine_id} (prefill restarted?)"
        )
    if payload.incarnation != remote.incarnation:
        raise PeerError(
            f"prefill engine {payload.engine_id} at {remote.host}:{target.port} was "
            f"restarted: it runs incarnation {payload.incarnation:x}, the request's "
            f"kv_transfer_params come from incarnation {remote.incarnation:x}"
        )
    if payload.compatibility_hash != local.compatibility_hash:
        raise PeerError(
            f"prefill engine {payload.engine_id} is incompatible with this decode engine: "
            + describe_mismatch(local.compatibility, payload.compatibility)
        )
    if payload.tp_rank != target.rank or payload.tp_size != remote.tp_size:
        raise PeerError(
            f"asked rank {target.rank} of tp_size {remote.tp_size}, got rank "
            f"{payload.tp_rank} of tp_size {payload.tp_size}"
        )
    if payload.cluster_id != target.cluster_id:
        # Pulls address the peer by the handshake's cluster id; params naming another
        # one come from a P configured differently from the one serving this address.
        raise PeerError(
            f"prefill engine {payload.engine_id} rank {payload.tp_rank} has cluster id "
            f"{payload.cluster_id}, its kv_transfer_params say {target.cluster_id} "
            "(remote_cluster_id + rank)"
        )
    # Whether the TP sizes can be mapped at all was settled before the handshake
    # (tp_mapping.check_shardable, in the worker's plan).
    fields = local.compatibility
    expected = (
        heads_per_rank(fields["num_kv_heads"], payload.tp_size)
        if fields["kv_split"] == "heads"
        else 1
    )
    if payload.units_per_block != expected:
        raise PeerError(
            f"prefill rank {payload.tp_rank} registered {payload.units_per_block} units "
            f"per block, {expected} expected for tp_size {payload.tp_size}"
        )
    try:
        ratio = blocks_per_block(payload.block_sizes, local.block_sizes)
    except BlockSizeMismatch as e:
        raise PeerError(f"prefill engine {payload.engine_id}: {e}") from None
    if ratio > 1 and not (payload.slice_bytes and payload.slice_bytes == local.slice_bytes):
        raise PeerError(
            f"prefill engine {payload.engine_id} has block_size {payload.block_sizes}, this "
            f"engine {local.block_sizes}, and a KV layout ({fields['kv_layout']}, "
            f"slices of {payload.slice_bytes} and {local.slice_bytes} bytes) that "
            "cannot assemble larger blocks from smaller ones: use equal block sizes"
        )
