"""What a decode rank's two receivers (of pulls and of pushes) share: the rank and its KV as
the engine sees it, which P ranks serve which of its heads and slices, its peers, and the one
sink where both report what ended."""

from __future__ import annotations

from dataclasses import dataclass

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.mapping.read_plans import ReadPlans
from hixl_connector.connector.outcomes import Outcomes
from hixl_connector.connector.peers.registry import PeerRegistry


@dataclass(frozen=True)
class DecodeRank:
    config: HixlConfig
    kv: RegisteredKV
    layout: KVLayout
    block_sizes: tuple[int, ...]  # per KV-cache group
    plans: ReadPlans
    peers: PeerRegistry
    tp_rank: int
    cluster_id: int
    outcomes: Outcomes
