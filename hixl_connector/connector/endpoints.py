"""The engine identity, at the bottom of the connector: a prefill engine as its
kv_transfer_params name it (``RemoteEndpoint``), one TP rank of it (``PeerRank``), and where
each rank of an engine is reached: its ports and its LLM-DataDist cluster id.

An engine (one engine id: a vLLM server with all its DP ranks) lays its ranks out at
consecutive positions of three windows, each starting at a configured base: side-channel
ports, transfer-engine ports and cluster ids. Rank ``tp_rank`` of DP rank ``dp_rank`` sits at
position ``dp_rank * tp_size + tp_rank``. P announces the port and cluster id of TP rank 0 of
its DP rank in kv_transfer_params, and D finds TP rank ``r`` of that DP rank ``r`` positions
further (``port_at`` and ``cluster_id_at`` from those bases).

The only place that does this arithmetic. Pure: every result is range-checked, and a
position, port or cluster id out of range raises ValueError naming the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hixl_connector.connector.limits import MAX_CLUSTER_ID, MAX_PORT, is_int

# Positions per engine: far more ranks than any deployment uses, and the stride of the
# derived cluster-id windows (config.derived_cluster_id_base), which must not overlap.
CLUSTER_ID_STEP = 1024


class AddressBases(Protocol):
    """Where an engine's windows start (HixlConfig has these three)."""

    @property
    def side_channel_port(self) -> int: ...

    @property
    def engine_port(self) -> int: ...  # 0: each rank's engine binds any free port

    @property
    def cluster_id_base(self) -> int: ...


@dataclass(frozen=True)
class RankAddress:
    cluster_id: int
    side_channel_port: int
    engine_port: int  # 0: any free port, announced in the handshake


def rank_position(dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """Position of a (dp, tp) rank in its engine's windows of ports and cluster ids."""
    for name, value, low in (("dp_rank", dp_rank, 0), ("tp_rank", tp_rank, 0)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}")
    position = dp_rank * tp_size + tp_rank
    if position >= CLUSTER_ID_STEP:
        raise ValueError(
            f"dp_rank={dp_rank} tp_rank={tp_rank} tp_size={tp_size} is rank position "
            f"{position}; an engine has at most {CLUSTER_ID_STEP} ranks"
        )
    return position


def port_at(name: str, base: int, position: int) -> int:
    """Port ``base + position``; base 0 (any free port) stays 0 for every rank."""
    _check_base(name, base, 0, MAX_PORT)
    _check_position(position)
    if base == 0:
        return 0
    port = base + position
    if port > MAX_PORT:
        raise ValueError(f"{name} {base} + rank position {position} gives port {port} > {MAX_PORT}")
    return port


def cluster_id_at(name: str, base: int, position: int) -> int:
    """Cluster id ``base + position``: LLM-DataDist cluster ids are int64."""
    _check_base(name, base, 0, MAX_CLUSTER_ID)
    _check_position(position)
    cluster_id = base + position
    if cluster_id > MAX_CLUSTER_ID:
        raise ValueError(
            f"{name} {base} + rank position {position} gives cluster id "
            f"{cluster_id} > {MAX_CLUSTER_ID}"
        )
    return cluster_id


def rank_address(bases: AddressBases, dp_rank: int, tp_rank: int, tp_size: int) -> RankAddress:
    """Everything a (dp, tp) rank listens on and is linked by."""
    position = rank_position(dp_rank, tp_rank, tp_size)
    return RankAddress(
        cluster_id=cluster_id_at("cluster_id_base", bases.cluster_id_base, position),
        side_channel_port=port_at("side_channel_port", bases.side_channel_port, position),
        engine_port=port_at("engine_port", bases.engine_port, position),
    )


def _check_base(name: str, base: int, low: int, high: int) -> None:
    if not is_int(base) or not low <= base <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {base!r}")


def _check_position(position: int) -> None:
    if not is_int(position) or not 0 <= position < CLUSTER_ID_STEP:
        raise ValueError(
            f"rank position must be an int in [0, {CLUSTER_ID_STEP}), got {position!r}"
        )


# A prefill engine's ranks share one window of ports and cluster ids.
MAX_TP_SIZE = CLUSTER_ID_STEP


@dataclass(frozen=True)
class RemoteEndpoint:
    """A prefill engine as its kv_transfer_params name it: rank 0's side channel and cluster id."""

    engine_id: str
    host: str
    port: int  # side channel port of P's tp rank 0; rank r listens on port + r
    tp_size: int
    cluster_id: int  # cluster id of P's tp rank 0; rank r's handshake must announce + r
    # P's start nonce (peers.incarnation): a P restarted at the same address, even under the same
    # engine id, is another endpoint, and its handshake must announce the same nonce.
    incarnation: int = 0

    def rank(self, p_rank: int) -> PeerRank:
        """One TP rank of this engine; raises ValueError when it has no such rank, or when
        that rank's port or cluster id would be out of range."""
        if not is_int(p_rank) or not 0 <= p_rank < self.tp_size:
            raise ValueError(
                f"prefill engine {self.engine_id} has tp_size {self.tp_size}, no rank {p_rank!r}"
            )
        try:
            port_at("remote_port", self.port, p_rank)
            cluster_id_at("remote_cluster_id", self.cluster_id, p_rank)
        except ValueError as e:
            raise ValueError(f"prefill engine {self.engine_id}: {e}") from None
        return PeerRank(self, p_rank)


@dataclass(frozen=True)
class PeerRank:
    """One TP rank of a prefill engine: what D handshakes, links, pulls from and notifies."""

    remote: RemoteEndpoint
    rank: int

    @property
    def port(self) -> int:
        """Its side-channel port."""
        return port_at("remote_port", self.remote.port, self.rank)

    @property
    def cluster_id(self) -> int:
        """The cluster id its handshake must announce."""
        return cluster_id_at("remote_cluster_id", self.remote.cluster_id, self.rank)

    @property
    def key(self) -> tuple[str, int, str, int]:
        """(engine id, incarnation, side-channel host, port): a restarted engine gets a new
        key, whatever its engine id."""
        return (self.remote.engine_id, self.remote.incarnation, self.remote.host, self.port)

    @property
    def address(self) -> tuple[str, int]:
        """(side-channel host, port): where whichever engine serves this rank now answers."""
        return (self.remote.host, self.port)


# Stands in for the peer when kv_transfer_params were unusable: such a spec carries an error.
UNKNOWN_ENDPOINT = RemoteEndpoint(engine_id="", host="", port=0, tp_size=1, cluster_id=0)
