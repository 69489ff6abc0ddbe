"""Typed, validated view of ``kv_connector_extra_config`` (plus the environment).

Every key is optional. A key this module does not know, or a value of the wrong type or
range, raises ``ValueError`` naming the key, so a bad deployment fails at start instead of at
the first transfer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.endpoints import CLUSTER_ID_STEP
from hixl_connector.connector.limits import MAX_CLUSTER_ID, MAX_PORT, is_int

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# A short token lets anyone who sniffs one HMAC challenge and its answer guess it offline;
# 32 characters of secrets.token_hex carry 128 bits. The native engine applies the same rule.
MIN_AUTH_TOKEN_CHARS = 32
# Read by the native engine too (datadist.native.llm_datadist.AUTH_TOKEN_ENV), repeated
# here because the scheduler half must not import the engine's package.
AUTH_TOKEN_ENV = "HIXL_AUTH_TOKEN"
# The native engine's limit (hixl_connector.datadist.api.config.MAX_TCP_CONNECTIONS), repeated
# here because the scheduler half must not import the engine's package.
MAX_TCP_CONNECTIONS = 16
# So are the native engine's listener caps (hixl_connector.datadist.api.config).
DEFAULT_SERVER_HANDSHAKES = 1024
DEFAULT_SERVER_CONNECTIONS = 4096
MAX_SERVER_CONNECTIONS = 1 << 20
TOKEN_RECIPE = "python -c 'import secrets; print(secrets.token_hex(32))'"
BACKENDS = ("auto", "native", "ascend")
TRANSPORTS = ("auto", "cma", "tcp")
# pull: D reads P's leased blocks once P finished; push: P writes into blocks D granted it.
CLUSTER_ID_SPACE = 2**31
MAX_TIMEOUT_S = (2**31 - 1) // 1000
# A DNS host name (RFC 1123): dot-separated labels of letters, digits and inner hyphens.
HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
MAX_HOST_NAME_CHARS = 253
# A request whose KV on a decode rank is this small is read in the step that computes its
# first token (sync_load_bytes): the native engine copies a same-host read this small on
# the step thread anyway (native/src/engine.cpp, kCopyHereBytes).
DEFAULT_SYNC_LOAD_BYTES = 1 << 20
MAX_SYNC_LOAD_BYTES = 1 << 30
# Keys an earlier release took, and what they are called now: the old name still works, with
# a warning, for at least one release after the rename (CHANGELOG.md lists each).
RENAMED_KEYS = {"load_in_step_bytes": "sync_load_bytes"}
# D unlinks a prefill rank no read used for this long (0: never); the next read links again.
DEFAULT_LINK_IDLE_S = 300.0


class TransferMode(str, Enum):
    """How KV reaches D: D reads P's blocks (pull), or P writes them into D's (push)."""

    PULL = "pull"
    PUSH = "push"


@dataclass(frozen=True)
class HixlConfig:
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5701
    engine_host: str = "127.0.0.1"
    engine_port: int = 0
    backend: str = "auto"
    transport: str = "auto"
    transfer_mode: TransferMode = TransferMode.PULL
    pull_timeout_s: float = 30.0
    # Push mode: how long D waits for P's word after it registered (by default
    # pull_timeout_s: both bound how long D waits for a request's KV).
    push_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    link_idle_s: float = DEFAULT_LINK_IDLE_S
    transfer_threads: int = 2
    tcp_connections: int = 2
    # P's engine listener: connections in the handshake at once, authenticated connections
    # (a D rank's link holds 1 + tcp_connections of them).
    server_handshakes: int = DEFAULT_SERVER_HANDSHAKES
    server_connections: int = DEFAULT_SERVER_CONNECTIONS
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    auth_token: str = ""
    cluster_id_base: int = 0
    sync_load_bytes: int = DEFAULT_SYNC_LOAD_BYTES
    # Ascend (backend "ascend"): LLMConfig.local_comm_res ("" or '{"version":"1.3"}' for
    # HixlCS), and whether P and D may be linked over HCCS (then KV bases must be 2 MB aligned).
    ascend_local_comm_res: str = ""
    ascend_hccs: bool = True

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any] | None, engine_id: str) -> HixlConfig:
        """Builds the config from ``kv_connector_extra_config``; raises ValueError."""
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
        extra = _renamed_keys_resolved(dict(extra or {}))
        valid = sorted(field.name for field in dataclasses.fields(cls))
        for key in extra:
            if key not in valid:
                raise ValueError(
                    f"unknown kv_connector_extra_config key {key!r}; valid keys: {', '.join(valid)}"
                )

        side_channel_host = _side_channel_host(extra, "side_channel_host", "127.0.0.1")
        lease_s = _positive_float(extra, "lease_s", 30.0)
        heartbeat_s = _positive_float(extra, "heartbeat_s", lease_s / 6)
        threads = _int(extra, "transfer_threads", 2, low=1)
        if heartbeat_s >= lease_s:
            raise ValueError(
                f"kv_connector_extra_config key 'heartbeat_s' must be < lease_s "
                f"({lease_s}), got {heartbeat_s!r}"
            )
        pull_timeout_s = _timeout_s(extra, "pull_timeout_s", 30.0)
        push_timeout_s = _timeout_s(extra, "push_timeout_s", pull_timeout_s)
        return cls(
            side_channel_host=side_channel_host,
            side_channel_port=_int(extra, "side_channel_port", 5701, low=1, high=MAX_PORT),
            engine_host=_ipv4(extra, "engine_host", side_channel_host),
            engine_port=_int(extra, "engine_port", 0, low=0, high=MAX_PORT),
            backend=_choice(extra, "backend", "auto", BACKENDS),
            transport=_choice(extra, "transport", "auto", TRANSPORTS),
            transfer_mode=TransferMode(
                _choice(extra, "transfer_mode", "pull", tuple(mode.value for mode in TransferMode))
            ),
            pull_timeout_s=pull_timeout_s,
            push_timeout_s=push_timeout_s,
            handshake_timeout_s=_timeout_s(extra, "handshake_timeout_s", 5.0),
            link_idle_s=_link_idle_s(extra, max(pull_timeout_s, push_timeout_s)),
            transfer_threads=threads,
            tcp_connections=_int(
                extra,
                "tcp_connections",
                min(threads, MAX_TCP_CONNECTIONS),
                low=1,
                high=MAX_TCP_CONNECTIONS,
            ),
            server_handshakes=_int(
                extra,
                "server_handshakes",
                DEFAULT_SERVER_HANDSHAKES,
                low=1,
                high=MAX_SERVER_CONNECTIONS,
            ),
            server_connections=_int(
                extra,
                "server_connections",
                DEFAULT_SERVER_CONNECTIONS,
                low=1 + MAX_TCP_CONNECTIONS,
                high=MAX_SERVER_CONNECTIONS,
            ),
            lease_s=lease_s,
            heartbeat_s=heartbeat_s,
            auth_token=_auth_token(extra),
            cluster_id_base=_int(
                extra,
                "cluster_id_base",
                derived_cluster_id_base(engine_id),
                low=0,
                high=MAX_CLUSTER_ID - CLUSTER_ID_STEP,
            ),
            sync_load_bytes=_int(
                extra,
                "sync_load_bytes",
                DEFAULT_SYNC_LOAD_BYTES,
                low=0,
                high=MAX_SYNC_LOAD_BYTES,
            ),
            ascend_local_comm_res=_json_object_or_empty(extra, "ascend_local_comm_res"),
            ascend_hccs=_bool(extra, "ascend_hccs", True),
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> HixlConfig:
        kv_transfer_config = vllm_config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("HixlConfig needs vllm_config.kv_transfer_config to be set")
        engine_id = kv_transfer_config.engine_id
        if not engine_id:
            raise ValueError("kv_transfer_config.engine_id is not set")
        check_parallelism(vllm_config.parallel_config)
        check_no_sleep_mode(vllm_config.model_config)
        return cls.from_dict(kv_transfer_config.kv_connector_extra_config, engine_id)

    @property
    def pushes(self) -> bool:
        """Push mode: P writes the KV into D (``transfer_mode: "push"``)."""
        return self.transfer_mode is TransferMode.PUSH


# Parallel layouts whose ranks hold a part of the layers or of the tokens: a rank's blocks
# are then not a whole request's KV for its heads, which is what a pull moves.
UNSUPPORTED_PARALLELISM = (
    ("pipeline_parallel_size", "--pipeline-parallel-size", "layers"),
    ("decode_context_parallel_size", "--decode-context-parallel-size", "tokens"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size", "tokens"),
)


def check_no_sleep_mode(model_config: Any) -> None:
    """Refuses, at start, vLLM's sleep mode. Sleeping releases the KV-cache memory this
    server registered for remote reads and writes; a peer holding those registrations would
    move bytes of memory that is no longer the KV. vLLM up to 0.32 never tells a connector
    it sleeps; 0.33 and 0.34 do (``unregister_kv_caches``, ``restore_kv_caches``), but serving
    through a sleep needs the memory re-registered on wake under a new incarnation, so that
    no peer uses the old one: not built, so refused."""
    if getattr(model_config, "enable_sleep_mode", False):
        raise ValueError(
            "hixl_connector does not support vLLM's sleep mode: sleeping releases the KV "
            "cache that peers read from and write into. Start vLLM without "
            "--enable-sleep-mode"
        )


def check_parallelism(parallel_config: Any) -> None:
    """Refuses, at start, parallel layouts hixl_connector cannot move KV for."""
    for name, flag, part in UNSUPPORTED_PARALLELISM:
        size = getattr(parallel_config, name, 1)
        if size != 1:
            raise ValueError(
                f"hixl_connector does not support {name}={size}: each rank would hold only "
                f"some of a request's {part}. Run this server with {flag} 1 (tensor and data "
                "parallelism are supported)"
            )
    nodes = getattr(parallel_config, "nnodes_within_dp", 1)
    if nodes > 1:
        raise ValueError(
            f"hixl_connector does not support tensor parallelism across nodes (one engine "
            f"spans {nodes} nodes, --nnodes {parallel_config.nnodes}): the engine's scheduler "
            "publishes each lease in shared memory that every TP rank maps, so all ranks of "
            "an engine must share a host. Keep each engine's TP within a node and add P or D "
            "instances (or data-parallel ranks) instead"
        )


def derived_cluster_id_base(engine_id: str) -> int:
    """Stable (process- and restart-independent) window start for an engine id."""
    digest = hashlib.sha256(engine_id.encode("utf-8")).digest()
    windows = CLUSTER_ID_SPACE // CLUSTER_ID_STEP
    return (int.from_bytes(digest[:8], "big") % windows) * CLUSTER_ID_STEP


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(
        f"kv_connector_extra_config key {key!r} must be {expected}, got {value!r} "
        f"({type(value).__name__})"
    )


def _int(
    extra: Mapping[str, Any], key: str, default: int, low: int, high: int | None = None
) -> int:
    value = extra.get(key, default)
    expected = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    if not is_int(value) or value < low or (high is not None and value > high):
        raise _bad(key, value, expected)
    return int(value)


def _positive_float(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(key, value, "a finite number > 0")
    return float(value)


def _timeout_s(extra: Mapping[str, Any], key: str, default: float) -> float:
    """LLM-DataDist takes timeouts as int32 milliseconds > 0."""
    value = _positive_float(extra, key, default)
    if not 0.001 <= value <= MAX_TIMEOUT_S:
        raise _bad(key, extra.get(key, default), f"seconds in [0.001, {MAX_TIMEOUT_S}]")
    return value


def _link_idle_s(extra: Mapping[str, Any], wait_s: float) -> float:
    """0 (never), or longer than D waits for a request's KV (``wait_s``: the longer of
    pull_timeout_s and push_timeout_s), so that no link closes under a read or a push; by
    default DEFAULT_LINK_IDLE_S, or twice ``wait_s`` where that is longer."""
    default = max(DEFAULT_LINK_IDLE_S, 2 * wait_s)
    value = extra.get("link_idle_s", default)
    if value == 0 and not isinstance(value, bool):
        return 0.0
    seconds = _positive_float(extra, "link_idle_s", default)
    if seconds <= wait_s:
        raise _bad(
            "link_idle_s",
            value,
            f"0 (never) or seconds > pull_timeout_s and push_timeout_s ({wait_s:g})",
        )
    return seconds


def _str(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        raise _bad(key, value, "a string")
    return value


def _auth_token(extra: Mapping[str, Any]) -> str:
    """The shared secret, from the key or else the environment; empty means no auth."""
    source = "kv_connector_extra_config key 'auth_token'"
    if "auth_token" not in extra and AUTH_TOKEN_ENV in os.environ:
        source = f"environment variable {AUTH_TOKEN_ENV} (read for key 'auth_token')"
    token = _str(extra, "auth_token", os.environ.get(AUTH_TOKEN_ENV, ""))
    if token and len(token) < MIN_AUTH_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds a {len(token)}-character token; it must be empty (no auth) or at "
            f"least {MIN_AUTH_TOKEN_CHARS} characters, since a short one can be guessed "
            f"offline from one HMAC exchange. Generate one with: {TOKEN_RECIPE}"
        )
    return token


def _host(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = _str(extra, key, default)
    if not value or value != value.strip():
        raise _bad(key, value, "a non-empty host name or address without spaces")
    return value


def _side_channel_host(extra: Mapping[str, Any], key: str, default: str) -> str:
    """ZeroMQ binds and connects to an IPv4 address, an IPv6 address (the side channel sets the
    socket's ipv6 option for one) or a host name; anything else would fail P's bind or every
    D's connect."""
    value = _host(extra, key, default)
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        if HOST_NAME.fullmatch(value) and len(value) <= MAX_HOST_NAME_CHARS:
            return value
    raise ValueError(
        f"kv_connector_extra_config key {key!r} must be an IPv4 address, an IPv6 address "
        f"without brackets (such as ::1) or a host name, got {value!r}"
    )


def _ipv4(extra: Mapping[str, Any], key: str, default: str) -> str:
    """Both transfer engines link by IPv4 literal (the native engine's link path and CANN's
    LLMClusterInfo convert with inet_aton): a host name or an IPv6 address would start fine and
    then fail every link, so refuse it now."""
    value = _host(extra, key, default)
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        where = "" if key in extra else f" (it follows side_channel_host {default!r})"
        raise ValueError(
            f"kv_connector_extra_config key {key!r} must be an IPv4 address such as 10.0.0.5, "
            f"got {value!r}{where}: the transfer engine (native or CANN's, on every backend) "
            f"links by IPv4 address only; set {key!r} to the IPv4 address peers reach this "
            "host at"
        ) from None
    return value


def _choice(extra: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(key, default)
    if value not in choices or not isinstance(value, str):
        raise _bad(key, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise _bad(key, value, "a bool (true or false)")
    return value


def _json_object_or_empty(extra: Mapping[str, Any], key: str) -> str:
    value = _str(extra, key, "")
    if value:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _bad(key, value, 'empty or a JSON object string such as \'{"version":"1.3"}\'')
    return value


def _renamed_keys_resolved(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with each renamed key under its new name (a warning names both); raises
    ValueError where both names are given."""
    for old, new in RENAMED_KEYS.items():
        if old not in extra:
            continue
        if new in extra:
            raise ValueError(
                f"kv_connector_extra_config keys {old!r} and {new!r} are one setting "
                f"({old!r} is its old name): give only {new!r}"
            )
        logger.warning(
            "hixl: kv_connector_extra_config key %r is now %r; the old name will be removed "
            "in a later release (CHANGELOG.md)",
            old,
            new,
        )
        extra[new] = extra.pop(old)
    return extra
