"""What a worker rank announces in its handshake: where its engine listens, its blocks, and
the compatibility fields D checks before it reads a byte."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.peers.handshake import (
    SCHEMA_VERSION,
    HandshakePayload,
    compatibility_hash,
)


def handshake_payload(
    vllm_config: Any,
    layout: KVLayout,
    engine_id: str,
    rank: tuple[int, int],
    cluster_id: int,
    engine_address: tuple[str, int],
    block_sizes: Sequence[int],
    kv_cache_config: Any,
) -> HandshakePayload:
    """This rank's payload; ``rank`` is (TP rank, TP size). Its incarnation is 0 here: P's
    scheduler writes it after the workers start, and the handshake answer carries it."""
    model = vllm_config.model_config
    block_size = int(vllm_config.cache_config.block_size)
    mla = bool(getattr(model, "use_mla", False))
    fields = {
        "model": str(model.model),
        "kv_layout": _kv_layout_name(layout, block_size),
        "kv_split": "replicated" if mla else "heads" if layout.head_major else "none",
        "num_kv_heads": int(model.get_total_num_kv_heads()),
        "head_size": int(model.get_head_size()),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "kv_cache_groups": describe_groups(kv_cache_config),
        # Both sides' KV in the same memory: no read is ever host-to-device or back, which
        # CANN serves only through a device memory pool (and between blocks caches only).
        "kv_memory": kv_memory(layout),
        **layout.compatibility_fields(block_size),
    }
    return HandshakePayload(
        schema_version=SCHEMA_VERSION,
        compatibility_hash=compatibility_hash(fields),
        compatibility=fields,
        engine_id=engine_id,
        tp_rank=rank[0],
        tp_size=rank[1],
        cluster_id=cluster_id,
        engine_host=engine_address[0],
        engine_port=engine_address[1],
        num_blocks=layout.num_blocks,
        units_per_block=layout.units_per_block,
        block_sizes=list(block_sizes),
        slice_bytes=layout.slice_bytes,
        state_parts=state_parts(layout.state),
        kv_parts=[[p.first, p.stride, p.length] for p in layout.state.kv_parts]
        if layout.state is not None
        else [],
        incarnation=0,
    )


def state_parts(state: StateLayout | None) -> list[list[int]]:
    """Where this engine's states lie, for D to read them from here (StateLayout.group_parts)."""
    if state is None:
        return []
    return [
        [group, part.first, part.stride, part.length]
        for group, parts in state.group_parts
        for part in parts
    ]


def kv_memory(layout: KVLayout) -> str:
    """Where the KV cache lives: "device" on an accelerator (an NPU), else "host"."""
    device = getattr(layout.views[0], "device", None) if layout.views else None
    return "device" if device is not None and device.type != "cpu" else "host"


def describe_groups(kv_cache_config: Any) -> list[str]:
    """Each KV-cache group as "<spec>:<sliding window>:<layers>": both sides must agree,
    since a group's block ids index the same layers' bytes on both (block sizes travel
    apart: P's may be smaller)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [
        f"{type(group.kv_cache_spec).__name__}:"
        f"{getattr(group.kv_cache_spec, 'sliding_window', None)}:{len(group.layer_names)}"
        for group in groups
    ]


def _kv_layout_name(layout: KVLayout, block_size: int) -> str:
    """Names what decides the bytes inside a block: the platform, its kernels, the shape of
    a unit with its token dimension as "B" (block sizes may differ)."""
    import torch
    from vllm.platforms import current_platform

    kernels = current_platform.device_type
    if kernels == "cpu":  # the CPU attention kernels pack blocks per ISA
        kernels += ":" + torch.backends.cpu.get_cpu_capability()
    # The shape of one registered unit: a KV head of a block where heads split.
    unit_shape = list(layout.block_shape[1:] if layout.head_major else layout.block_shape)
    dims = [str(d) for d in unit_shape]
    if block_size in unit_shape:
        dims[unit_shape.index(block_size)] = "B"
    return f"{kernels}/{layout.tensors_per_layer}x[{'x'.join(dims)}]"
