"""Everything that crosses a process boundary.

- scheduler -> worker: the per-step ``HixlConnectorMetadata`` (pickled by vLLM);
- P -> router -> D: ``kv_transfer_params`` (NixlConnector pull fields plus HIXL fields);
- worker <-> worker: the handshake payload and the done/heartbeat/release notifications,
  as dicts of msgpack-able primitives only (str, int, bool, None, list, dict).

Whatever arrives from another process is validated here, and a bad message raises
``ValueError`` with a message that says which field was wrong and how.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hixl_connector.connector.limits import MAX_CLUSTER_ID, MAX_U64, is_int
from hixl_connector.connector.rank_addresses import CLUSTER_ID_STEP, cluster_id_at, port_at

SCHEMA_VERSION = 3
# A prefill engine's ranks share one window of ports and cluster ids (rank_addresses).
MAX_TP_SIZE = CLUSTER_ID_STEP
MAX_KV_CACHE_GROUPS = 64
MAX_BLOCK_SIZE = 2**20
MAX_LEASE_SLOT = 2**32


# --- scheduler -> worker


@dataclass(frozen=True)
class RemoteEndpoint:
    """A prefill engine as its kv_transfer_params name it: rank 0's side channel and cluster id."""

    engine_id: str
    host: str
    port: int  # side channel port of P's tp rank 0; rank r listens on port + r
    tp_size: int
    cluster_id: int  # cluster id of P's tp rank 0; rank r's handshake must announce + r

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
    def key(self) -> tuple[str, str, int]:
        """(engine id, side-channel host, port): a restarted engine gets a new key."""
        return (self.remote.engine_id, self.remote.host, self.port)


# Stands in for the peer when kv_transfer_params were unusable: such a spec carries an error.
UNKNOWN_ENDPOINT = RemoteEndpoint(engine_id="", host="", port=0, tp_size=1, cluster_id=0)


@dataclass(frozen=True)
class RecvSpec:
    """D: pull ``remote_block_ids`` into ``local_block_ids`` (suffix-trimmed).

    A non-empty ``error`` means the scheduler refused the transfer (unusable params, or P
    offers fewer blocks than D needs). The worker must then report the request in
    ``failed_recving`` (and ``finished_recving``) with that message, pull nothing, and
    send "release" to P when ``remote.engine_id`` is known.
    """

    request_id: str
    remote_request_id: str
    lease_id: int
    remote: RemoteEndpoint
    local_block_ids: tuple[int, ...]
    # ``blocks_per_block`` of P's blocks per local block: P's may be smaller (block_slices);
    # NULL_BLOCK_ID where the prompt ends before the last local block does.
    remote_block_ids: tuple[int, ...]
    error: str = ""
    blocks_per_block: int = 1
    # Where P publishes the lease, and the word D must find there around its read.
    lease_slot: int = 0
    lease_word: int = 0


@dataclass(frozen=True)
class ReleaseSpec:
    """D: nothing to pull (full local prefix hit, or aborted before allocation); free P."""

    request_id: str
    remote_request_id: str
    lease_id: int
    remote: RemoteEndpoint


@dataclass(frozen=True)
class SendSpec:
    """P: keep a request's blocks leased until "done"/"release" from every consumer, or
    expiry. The blocks themselves stay with vLLM (delay-free) and in the lease word."""

    request_id: str
    lease_id: int
    slot: int  # its lease word's slot (lease_words)
    word: int  # the word published there


@dataclass
class HixlConnectorMetadata:
    """One step's work for the workers. A plain dataclass, so the scheduler half imports no
    vLLM (and no torch); the connector registers it as vLLM's KVConnectorMetadata."""

    to_recv: list[RecvSpec] = field(default_factory=list)
    to_release: list[ReleaseSpec] = field(default_factory=list)
    to_send: list[SendSpec] = field(default_factory=list)
    # D: requests aborted after their RecvSpec: not read if not yet read, P told at once.
    to_cancel: list[str] = field(default_factory=list)
    # D: (remote, remote_request_id, lease_id) of requests still waiting for their KV.
    heartbeats: list[tuple[RemoteEndpoint, str, int]] = field(default_factory=list)
    # Nothing was scheduled this step: vLLM runs it only to collect finished transfers.
    idle: bool = False


# --- kv_transfer_params


class InvalidTransferParams(ValueError):
    """kv_transfer_params from P (through the router) cannot drive a pull."""


REQUIRED_PARAMS = (
    *("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host"),
    *("remote_port", "tp_size", "remote_cluster_id", "remote_lease_id", "remote_lease_slot"),
)


@dataclass(frozen=True)
class RemotePrefill:
    """D's validated view of P's kv_transfer_params."""

    remote: RemoteEndpoint
    remote_request_id: str
    lease_id: int
    lease_slot: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, by position in the prompt
    num_tokens: int | None
    # Tokens per block of each of P's KV-cache groups; None: not sent (taken to be D's own;
    # the handshake checks it).
    block_sizes: tuple[int, ...] | None = None


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Validates P's params on D; raises InvalidTransferParams naming what is wrong.

    ``remote_cluster_id`` is required and read: P's rank r must announce
    ``remote_cluster_id + r`` in its handshake, and D refuses to link a rank that announces
    another cluster id (PeerRegistry), so params and the engine D links always agree.
    """
    if not isinstance(params, Mapping):
        raise InvalidTransferParams(f"kv_transfer_params must be a dict, got {params!r}")
    missing = [key for key in REQUIRED_PARAMS if params.get(key) is None]
    if missing:
        raise InvalidTransferParams(
            "kv_transfer_params for a remote prefill lack required field(s) "
            f"{', '.join(missing)}; pass P's returned kv_transfer_params to D unchanged"
        )
    check = functools.partial(_check, "kv_transfer_params")
    try:
        for key, expected in (("dcp_size", 1), ("pp_size", 1), ("transfer_mode", "pull")):
            if params.get(key) not in (None, expected):
                raise ValueError(f"{key} must be {expected!r}, got {params.get(key)!r}")
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None:
            check("remote_num_tokens", num_tokens, int, 0)
        remote = RemoteEndpoint(
            engine_id=check("remote_engine_id", params, str),
            host=check("remote_host", params, str),
            port=check("remote_port", params, int, 1, 65535),
            tp_size=check("tp_size", params, int, 1, MAX_TP_SIZE),
            cluster_id=check("remote_cluster_id", params, int, 0, MAX_CLUSTER_ID),
        )
        block_ids = _groups(params["remote_block_ids"])
        block_sizes = params.get("remote_block_size")
        if block_sizes is not None:
            if not isinstance(block_sizes, list) or len(block_sizes) != len(block_ids):
                raise ValueError(
                    f"remote_block_size must list one block size per KV-cache group "
                    f"({len(block_ids)}), got {block_sizes!r:.200}"
                )
            for size in block_sizes:
                check("remote_block_size", size, int, 1, MAX_BLOCK_SIZE)
        return RemotePrefill(
            remote=remote,
            remote_request_id=check("remote_request_id", params, str),
            lease_id=check("remote_lease_id", params, int, 0, MAX_U64),
            lease_slot=check("remote_lease_slot", params, int, 0, MAX_LEASE_SLOT),
            block_ids=block_ids,
            num_tokens=num_tokens,
            block_sizes=tuple(block_sizes) if block_sizes is not None else None,
        )
    except InvalidTransferParams:
        raise
    except ValueError as exc:
        raise InvalidTransferParams(f"invalid kv_transfer_params: {exc}") from None


def build_remote_decode_params(
    endpoint: RemoteEndpoint,
    request_id: str,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    lease: tuple[int, int],
    block_sizes: Sequence[int],
) -> dict[str, Any]:
    """P's answer in request_finished: where and what D pulls (NixlConnector pull fields).

    ``endpoint`` describes P itself: its rank-0 side channel port and cluster id;
    ``block_ids`` one list per KV-cache group, ``block_sizes`` their block sizes;
    ``lease`` the lease id and the slot of its lease word.
    """
    lease_id, lease_slot = lease
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[int(block_id) for block_id in group] for group in block_ids],
        "remote_block_size": [int(size) for size in block_sizes],
        "remote_engine_id": endpoint.engine_id,
        "remote_request_id": request_id,
        "remote_host": endpoint.host,
        "remote_port": endpoint.port,
        "tp_size": endpoint.tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_cluster_id": endpoint.cluster_id,
        "remote_lease_id": lease_id,
        "remote_lease_slot": lease_slot,
    }


def _groups(value: Any) -> tuple[tuple[int, ...], ...]:
    """Accepts list[list[int]] (one list per KV-cache group) or a flat list[int] (one group)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"remote_block_ids must be a list, got {value!r:.200}")
    if not (value and all(isinstance(group, (list, tuple)) for group in value)):
        value = [value]
    if len(value) > MAX_KV_CACHE_GROUPS:
        raise ValueError(
            f"remote_block_ids has {len(value)} KV cache groups, more than {MAX_KV_CACHE_GROUPS}"
        )
    for group in value:
        for block_id in group:
            if not is_int(block_id) or block_id < 0:
                raise ValueError(f"remote_block_ids holds {block_id!r}, not a block id >= 0")
    return tuple(tuple(group) for group in value)


# --- handshake

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
        _check(where, name, fields, kind, 1 if kind is int else None)
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
        declared = _check(where, "compatibility_hash", data, str)
        if declared != compatibility_hash(compatibility):
            raise ValueError(f"{where} compatibility_hash does not match its own fields")
        tp_size = _check(where, "tp_size", data, int, 1)
        tp_rank = _check(where, "tp_rank", data, int, 0)
        if tp_rank >= tp_size:
            raise ValueError(f"{where} tp_rank {tp_rank} is out of range for tp_size {tp_size}")
        return cls(
            schema_version=SCHEMA_VERSION,
            compatibility_hash=declared,
            compatibility=compatibility,
            engine_id=_check(where, "engine_id", data, str),
            tp_rank=tp_rank,
            tp_size=tp_size,
            cluster_id=_check(where, "cluster_id", data, int, 0, MAX_CLUSTER_ID),
            engine_host=_check(where, "engine_host", data, str),
            engine_port=_check(where, "engine_port", data, int, 1, 65535),
            num_blocks=_check(where, "num_blocks", data, int, 1),
            units_per_block=_check(where, "units_per_block", data, int, 1, 65535),
            block_sizes=_block_sizes(where, data.get("block_sizes")),
            slice_bytes=_check(where, "slice_bytes", data, int, 0, 2**20),
        )


def _block_sizes(where: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KV_CACHE_GROUPS:
        raise ValueError(
            f"{where} field 'block_sizes' must be a list of 1 to "
            f"{MAX_KV_CACHE_GROUPS} ints, got {value!r:.200}"
        )
    for size in value:
        _check(where, "block_sizes", size, int, 1, MAX_BLOCK_SIZE)
    return list(value)


# --- validation helpers
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


def _check(
    where: str,
    name: str,
    data: Any,
    kind: type,
    low: int | None = None,
    high: int | None = None,
) -> Any:
    """Returns ``data[name]`` (or ``data`` itself when it is not a mapping) if well-typed."""
    value: Any = data.get(name) if isinstance(data, Mapping) else data
    if kind is int:
        ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
        expected = "an int" + (f" >= {low}" if low is not None else "")
        expected += f" <= {high}" if high is not None else ""
    else:
        ok = isinstance(value, str) and bool(value)
        expected = "a non-empty string"
    if not ok:
        raise ValueError(f"{where} field {name!r} must be {expected}, got {value!r}")
    return value
