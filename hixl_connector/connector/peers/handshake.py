"""The handshake D asks of each prefill rank, and the check that P and D can share KV.

D sends ``{"type": "handshake", "schema": SCHEMA_VERSION}`` to P's rank r on its side
channel (the envelope names the rank and P's incarnation); P's rank r answers with its
``HandshakePayload``: where its engine listens, its cluster id, its registered blocks, and
the compatibility fields (model, dtype, KV layout...) with their hash. D links only a
payload whose schema, hash and rank it expects; a mismatch names each differing field.
Everything is msgpack-able primitives, and whatever arrives is validated here: a bad payload
raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.limits import (
    MAX_BLOCK_SIZE,
    MAX_CLUSTER_ID,
    MAX_KV_CACHE_GROUPS,
    MAX_PORT,
    MAX_STATE_PARTS,
    MAX_STATE_UNIT,
    MAX_U64,
    check_field,
    is_int,
)

# The tensors of an attention layer (K and V; an MLA layer's parts).
MAX_KV_PARTS = 8
# Version of the handshake and its payload; it is hashed with the compatibility fields, so a
# peer speaking another version is refused before D links it.
SCHEMA_VERSION = 7

# What must be equal on both sides for KV to be copied byte for byte, whatever the TP sizes
# and block sizes. A block of one tensor is ``units_per_block`` units of ``unit_token_bytes``
# per token (one KV head each when ``kv_split`` is "heads"); TP shapes the unit count per
# rank and block sizes may differ (block_slices), so those travel beside the fields. A
# payload may carry further fields (msgpack primitives); they are hashed and compared too.
COMPATIBILITY_FIELD_TYPES: dict[str, type] = {
    **dict.fromkeys(("model", "dtype", "kv_layout", "kv_split"), str),
    **dict.fromkeys(("num_layers", "num_kv_heads", "head_size"), int),
    **dict.fromkeys(("unit_token_bytes", "tensors_per_layer", "num_tensors"), int),
}
# How a block divides between TP ranks: by KV head (heads contiguous inside a block), not at
# all because every rank holds the whole (MLA-style) cache, or not at all (interleaved heads).
KV_SPLITS = ("heads", "replicated", "none")


def compatibility_hash(fields: Mapping[str, Any]) -> str:
    """sha256 (hex) of a canonical encoding: sorted keys, no whitespace, schema version."""
    try:
        canonical = json.dumps(
            {"schema_version": SCHEMA_VERSION, "fields": dict(fields)},
            sort_keys=True,
            separators=(",", ":"),
        )
    except TypeError as exc:
        raise ValueError(f"compatibility fields must be plain values: {exc}") from None
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def describe_mismatch(local_fields: Mapping[str, Any], remote_fields: Mapping[str, Any]) -> str:
    """One entry per differing field with both values; "" when the fields agree."""
    missing = "<missing>"
    return "; ".join(
        f"{name}: local={local_fields.get(name, missing)!r} "
        f"remote={remote_fields.get(name, missing)!r}"
        for name in sorted(set(local_fields) | set(remote_fields))
        if local_fields.get(name, missing) != remote_fields.get(name, missing)
    )


def validate_compatibility_fields(fields: Any) -> dict[str, Any]:
    where = "handshake compatibility"
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(fields).__name__}")
    for name, kind in COMPATIBILITY_FIELD_TYPES.items():
        check_field(where, name, fields, kind, 1 if kind is int else None)
    if fields["kv_split"] not in KV_SPLITS:
        raise ValueError(
            f"{where} field 'kv_split' must be one of {KV_SPLITS}, got {fields['kv_split']!r}"
        )
    for name, value in fields.items():
        if not isinstance(name, str) or not _is_primitive(value):
            raise ValueError(f"{where} field {name!r} holds a non-primitive value {value!r}")
    return dict(fields)


@dataclass(frozen=True)
class HandshakePayload:
    schema_version: int
    compatibility_hash: str
    compatibility: dict[str, Any]  # see COMPATIBILITY_FIELD_TYPES
    engine_id: str
    tp_rank: int
    tp_size: int
    cluster_id: int
    engine_host: str
    engine_port: int
    num_blocks: int
    units_per_block: int  # registered units per block: this rank's KV heads, or 1
    block_sizes: list[int]  # tokens per block of each KV-cache group
    slice_bytes: int  # bytes of one registered slice (block_slices); 0: not registered
    # Where each state group's state of a block lies in the state registration: [group,
    # first unit, units between blocks, units] per part (state_groups.StatePart); empty: none.
    state_parts: list[list[int]]
    # Where an attention block's KV lies in the state registration, where it lies beside the
    # states (vllm-ascend's planes): [first unit, units between blocks, units] per tensor of
    # a layer; empty where the KV is registered on its own.
    kv_parts: list[list[int]]
    incarnation: int  # P's start nonce (peers.incarnation); 0 on an engine that does not prefill

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "compatibility": dict(self.compatibility)
        }

    @classmethod
    def from_dict(cls, data: Any) -> HandshakePayload:
        where = "handshake payload"
        _check_schema(where, data)
        expected = set(cls.__dataclass_fields__)
        if set(data) != expected:
            raise ValueError(
                f"{where} fields differ from schema {SCHEMA_VERSION}: "
                f"missing {sorted(expected - set(data))}, unknown {sorted(set(data) - expected)}"
            )
        compatibility = validate_compatibility_fields(data["compatibility"])
        declared = check_field(where, "compatibility_hash", data, str)
        if declared != compatibility_hash(compatibility):
            raise ValueError(f"{where} compatibility_hash does not match its own fields")
        tp_size = check_field(where, "tp_size", data, int, 1)
        tp_rank = check_field(where, "tp_rank", data, int, 0)
        if tp_rank >= tp_size:
            raise ValueError(f"{where} tp_rank {tp_rank} is out of range for tp_size {tp_size}")
        return cls(
            schema_version=SCHEMA_VERSION,
            compatibility_hash=declared,
            compatibility=compatibility,
            engine_id=check_field(where, "engine_id", data, str),
            tp_rank=tp_rank,
            tp_size=tp_size,
            cluster_id=check_field(where, "cluster_id", data, int, 0, MAX_CLUSTER_ID),
            engine_host=check_field(where, "engine_host", data, str),
            engine_port=check_field(where, "engine_port", data, int, 1, MAX_PORT),
            num_blocks=check_field(where, "num_blocks", data, int, 1),
            units_per_block=check_field(where, "units_per_block", data, int, 1, 65535),
            block_sizes=_block_sizes(where, data.get("block_sizes")),
            slice_bytes=check_field(where, "slice_bytes", data, int, 0, 2**20),
            state_parts=_state_parts(where, data.get("state_parts")),
            kv_parts=_kv_parts(where, data.get("kv_parts")),
            incarnation=check_field(where, "incarnation", data, int, 0, MAX_U64),
        )


def _block_sizes(where: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KV_CACHE_GROUPS:
        raise ValueError(
            f"{where} field 'block_sizes' must be a list of 1 to "
            f"{MAX_KV_CACHE_GROUPS} ints, got {value!r:.200}"
        )
    for size in value:
        check_field(where, "block_sizes", size, int, 1, MAX_BLOCK_SIZE)
    return list(value)


# [group, first unit, units between blocks, units] of a state's part; [first, stride, units]
# of a KV tensor's part: each column's bounds.
STATE_PART_BOUNDS = (
    (0, MAX_KV_CACHE_GROUPS - 1),
    (0, MAX_STATE_UNIT),
    (0, MAX_STATE_UNIT),
    (1, MAX_STATE_UNIT),
)
KV_PART_BOUNDS = STATE_PART_BOUNDS[1:]


def _state_parts(where: str, value: Any) -> list[list[int]]:
    return _rows(where, "state_parts", value, MAX_STATE_PARTS, STATE_PART_BOUNDS)


def _kv_parts(where: str, value: Any) -> list[list[int]]:
    return _rows(where, "kv_parts", value, MAX_KV_PARTS, KV_PART_BOUNDS)


def _rows(
    where: str, name: str, value: Any, most: int, bounds: tuple[tuple[int, int], ...]
) -> list[list[int]]:
    """A list of at most ``most`` rows of ints, each column within its ``bounds``."""
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(
            f"{where} field {name!r} must be a list of at most {most} parts, got {value!r:.200}"
        )
    for row in value:
        if not isinstance(row, list) or len(row) != len(bounds):
            raise ValueError(
                f"{where} field {name!r} holds lists of {len(bounds)} ints, got {row!r:.200}"
            )
        for number, (low, high) in zip(row, bounds, strict=True):
            check_field(where, name, number, int, low, high)
    return [list(row) for row in value]


def _is_primitive(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    return isinstance(value, list) and all(_is_primitive(item) for item in value)


def _check_schema(where: str, data: Any) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or not is_int(version):
        raise ValueError(
            f"{where} uses schema version {version!r} but this side speaks {SCHEMA_VERSION}; "
            "run the same hixl_connector version on prefill and decode"
        )
