"""Where one TP rank of an engine is reached: its ports and its LLM-DataDist cluster id.

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
