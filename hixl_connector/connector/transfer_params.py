"""What P tells D through the router: ``kv_transfer_params``, built on P and validated on D.

NixlConnector's pull fields plus the project's own (README, "What travels in
kv_transfer_params"), and the identity-only params vllm-router sends D in push mode. Params
that arrive from another process are validated here, and bad ones raise
``InvalidTransferParams`` naming the field.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.endpoints import MAX_TP_SIZE, RemoteEndpoint
from hixl_connector.connector.limits import (
    MAX_BLOCK_SIZE,
    MAX_CLUSTER_ID,
    MAX_KV_CACHE_GROUPS,
    MAX_LEASE_SLOT,
    MAX_PORT,
    MAX_U64,
    check_field,
    is_int,
)


class InvalidTransferParams(ValueError):
    """kv_transfer_params from P (through the router) cannot drive a pull."""


# The fields of P's params that NixlConnector's do not have; params with none of them come
# from another connector.
OWN_PARAMS = ("remote_cluster_id", "remote_lease_id", "remote_lease_slot", "remote_incarnation")
REQUIRED_PARAMS = (
    *("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host"),
    *("remote_port", "tp_size"),
    *OWN_PARAMS,
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
    """Validates P's params on D; raises InvalidTransferParams naming what is wrong and the
    prefill engine the params name (who sent them, as far as they tell).

    ``remote_cluster_id`` is required and read: P's rank r must announce
    ``remote_cluster_id + r`` in its handshake, and D refuses to link a rank that announces
    another cluster id (PeerRegistry), so params and the engine D links always agree.
    """
    try:
        return _parse_remote_prefill(params)
    except InvalidTransferParams as exc:
        raise InvalidTransferParams(f"{exc} ({_sender(params)})") from None


def _sender(params: Any) -> str:
    if not isinstance(params, Mapping):
        return "from an unknown sender"
    engine, host = params.get("remote_engine_id"), params.get("remote_host")
    if engine is None and host is None:
        return "they name no prefill engine"
    # Hostile params: every value shown bounded.
    return (
        f"sent for prefill engine {engine!r:.80} at {host!r:.80}:{params.get('remote_port')!r:.12}"
    )


def _parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    if not isinstance(params, Mapping):
        raise InvalidTransferParams(f"kv_transfer_params must be a dict, got {params!r}")
    missing = [key for key in REQUIRED_PARAMS if params.get(key) is None]
    if missing:
        raise InvalidTransferParams(
            "kv_transfer_params for a remote prefill lack required field(s) "
            f"{', '.join(missing)}; pass P's returned kv_transfer_params to D unchanged"
        )
    check = functools.partial(check_field, "kv_transfer_params")
    try:
        for key, expected in (("dcp_size", 1), ("pp_size", 1)):
            if params.get(key) not in (None, expected):
                raise ValueError(f"{key} must be {expected!r}, got {params.get(key)!r}")
        if params.get("transfer_mode") not in (None, "pull", "push"):
            raise ValueError(
                f"transfer_mode must be 'pull' or 'push', got {params.get('transfer_mode')!r}"
            )
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None:
            check("remote_num_tokens", num_tokens, int, 0)
        remote = RemoteEndpoint(
            engine_id=check("remote_engine_id", params, str),
            host=check("remote_host", params, str),
            port=check("remote_port", params, int, 1, MAX_PORT),
            tp_size=check("tp_size", params, int, 1, MAX_TP_SIZE),
            cluster_id=check("remote_cluster_id", params, int, 0, MAX_CLUSTER_ID),
            incarnation=check("remote_incarnation", params, int, 1, MAX_U64),
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


# vLLM appends "-<8 hex>" to the request id a client sent; P's and D's legs of one request
# (sent with one X-Request-Id) share what is left.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    return _RANDOM_SUFFIX.sub("", request_id)


def is_push_identity(params: Mapping[str, Any]) -> bool:
    """Params vllm-router sends D once P answered with its push identity, on every leg after
    that answer: P's engine id, address and TP size (and the X-Request-Id as
    remote_request_id), no blocks and no lease."""
    return params.get("remote_block_ids") is None and params.get("remote_lease_id") is None


def parse_push_identity(params: Mapping[str, Any]) -> RemoteEndpoint:
    """P's identity as the router sends it to D in a concurrent push leg; raises
    InvalidTransferParams naming what is wrong."""
    check = functools.partial(check_field, "kv_transfer_params")
    try:
        return RemoteEndpoint(
            engine_id=check("remote_engine_id", params, str),
            host=check("remote_host", params, str),
            port=check("remote_port", params, int, 1, MAX_PORT),
            tp_size=check("tp_size", params, int, 1, MAX_TP_SIZE),
            cluster_id=0,
            incarnation=0,
        )
    except ValueError as exc:
        raise InvalidTransferParams(
            f"invalid kv_transfer_params for a push: {exc} ({_sender(params)})"
        ) from None


def build_remote_decode_params(
    endpoint: RemoteEndpoint,
    request_id: str,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    lease: tuple[int, int],
    block_sizes: Sequence[int],
    transfer_mode: str = "pull",
) -> dict[str, Any]:
    """P's answer in request_finished: where and what D pulls (NixlConnector pull fields).
    With ``transfer_mode`` "push" it is also P's push identity, which makes vllm-router send
    later requests to P and D at once (D then registers its blocks, is_push_identity).

    ``endpoint`` describes P itself: its rank-0 side channel port, cluster id and incarnation;
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
        "transfer_mode": transfer_mode,
        "remote_cluster_id": endpoint.cluster_id,
        "remote_lease_id": lease_id,
        "remote_lease_slot": lease_slot,
        "remote_incarnation": endpoint.incarnation,
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
