"""What both sides of the fabric check share: the probe KV cache (a layer's K and V on one
device, 2 MB aligned, as vllm-ascend allocates the KV), its bytes, the lease it is read under,
and an engine registered the way the connector registers one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RankAddress
from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.registered_kv import RegisteredKV, register_kv
from hixl_connector.connector.kv.word_memory import aligned_zeros
from hixl_connector.connector.leases.guarded_read import lease_word

# Fixed, so that P and D on two hosts agree without talking: cluster ids far from any
# engine's (config.derived_cluster_id_base), the lease and P's start nonce.
PREFILL_CLUSTER_ID = 900_001
DECODE_CLUSTER_ID = 900_002
PROBE_LEASE_ID = 1
PROBE_INCARNATION = 0xC4EC4
LEASE_SLOT = 0
UNPUBLISHED_SLOT = 1  # never published: a read under it must be refused
TENSORS = 2  # one layer's K and V


@dataclass(frozen=True)
class ProbeShape:
    num_blocks: int
    block_bytes: int

    def word(self) -> int:
        """The lease word P publishes for all its probe blocks."""
        return lease_word(PROBE_LEASE_ID, [list(range(self.num_blocks))], PROBE_INCARNATION)


def probe_values(tensor: int, blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """The bytes P's ``blocks`` of K (0) or V (1) hold: [len(blocks), block_bytes] uint8,
    different in every block, tensor and byte position."""
    position = torch.arange(block_bytes, dtype=torch.int64)
    values = blocks.view(-1, 1).to(torch.int64) * 7 + position * 13 + tensor * 101
    return (values % 251).to(torch.uint8)


def probe_kv(shape: ProbeShape, device: str, fill: bool) -> dict[str, tuple[Any, Any]]:
    """K and V of one layer, [num_blocks, block_bytes] uint8 on ``device``; with ``fill``,
    P's bytes (probe_values), else zeroes."""
    parts = []
    for tensor in range(TENSORS):
        memory = aligned_zeros(shape.num_blocks * shape.block_bytes, torch.uint8, device)
        view = memory.view(shape.num_blocks, shape.block_bytes)
        if fill:
            blocks = torch.arange(shape.num_blocks)
            view.copy_(probe_values(tensor, blocks, shape.block_bytes).to(view.device))
        parts.append(view)
    return {"probe.layer": (parts[0], parts[1])}


def register(
    config: HixlConfig, kv: dict[str, tuple[Any, Any]], shape: ProbeShape, prefill: bool
) -> tuple[RegisteredKV, KVLayout]:
    """The probe KV registered as the connector registers a P (``prefill``) or a D rank."""
    layout = describe_kv_caches(kv, shape.num_blocks)
    cluster_id = PREFILL_CLUSTER_ID if prefill else DECODE_CLUSTER_ID
    rank = RankAddress(cluster_id, 0, config.engine_port)
    return register_kv(config, layout, rank, producer=prefill, consumer=not prefill), layout
