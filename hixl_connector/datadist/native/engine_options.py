"""The native engine's options: what ``LLMDataDist.init`` derives from LLMConfig's options as
CANN derives them, and the engine's constructor arguments (the ``hixl.*`` keys, README.md)."""

from __future__ import annotations

import os

from hixl_connector.datadist.api.config import (
    DEFAULT_SERVER_CONNECTIONS,
    DEFAULT_SERVER_HANDSHAKES,
    MAX_SERVER_CONNECTIONS,
    MAX_SERVER_THREADS,
    MAX_TCP_CONNECTIONS,
    MAX_TRANSFER_THREADS,
    OPT_AUTH_TOKEN,
    OPT_LINKS_BOTH_WAYS,
    OPT_SERVER_CONNECTIONS,
    OPT_SERVER_HANDSHAKES,
    OPT_SERVER_THREADS,
    OPT_TCP_CONNECTIONS,
    OPT_TRANSFER_THREADS,
    OPT_TRANSPORT,
    TRANSPORTS,
)
from hixl_connector.datadist.api.status import LLMStatusCode, raise_if_false

AUTH_TOKEN_ENV = "HIXL_AUTH_TOKEN"


def int_option(options: dict[str, str], key: str, default: int, low: int, high: int) -> int:
    raw = options.get(key)
    if raw is None:
        return default
    raise_if_false(
        raw.isdigit() and low <= int(raw) <= high,
        f"option {key}={raw!r} must be an integer in [{low}, {high}]",
    )
    return int(raw)


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    raise_if_false(
        bool(sep) and bool(host) and port.isdigit() and int(port) <= 65535,
        f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"',
    )
    return host, int(port)


def derived_options(options: dict[str, str], role_name: str) -> dict[str, str]:
    """Derived options, as CANN derives them (local_comm_res and transfer_backend imply
    cache-manager and remote-accessible mode)."""
    opts = dict(options)
    opts["llm.Role"] = role_name
    if "llm.LocalCommRes" in options:
        opts.setdefault("llm.EnableCacheManager", "1")
        opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
    raise_if_false(
        opts.get("llm.EnableCacheManager") == "1",
        "the native engine implements the v2 cache-manager API only: set "
        "LLMConfig.enable_cache_manager = True",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    )
    if "llm.TransferBackend" in options:
        raise_if_false(
            options["llm.TransferBackend"] == "hixl",
            f"llm.TransferBackend {options['llm.TransferBackend']!r} is not supported, use 'hixl'",
        )
        opts.setdefault("llm.EnableRemoteCacheAccessible", "1")
        raise_if_false(
            opts["llm.EnableRemoteCacheAccessible"] == "1",
            "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible "
            "is not enable.",
        )
        raise_if_false(
            "llm.listenIpInfo" in options,
            "llm.TransferBackend is not supported when llm.listenIpInfo is not configured.",
        )
    raise_if_false(
        "ge.exec.deviceId" in opts, "ge.exec.deviceId is required (set LLMConfig.device_id)"
    )
    return opts


def engine_args(
    opts: dict[str, str],
) -> tuple[str, int, str, str, int, int, int, int, int, bool]:
    host, port = "", -1
    if opts.get("llm.listenIpInfo"):
        host, port = parse_listen_ip_info(opts["llm.listenIpInfo"])
    token = opts.get(OPT_AUTH_TOKEN, os.environ.get(AUTH_TOKEN_ENV, ""))
    transport = opts.get(OPT_TRANSPORT, "auto")
    raise_if_false(
        transport in TRANSPORTS,
        f"option {OPT_TRANSPORT}={transport!r} must be one of {TRANSPORTS}",
    )
    threads = int_option(opts, OPT_TRANSFER_THREADS, 2, 1, MAX_TRANSFER_THREADS)
    # One TCP connection per transfer thread by default: a pull's chunks then travel at
    # once instead of queueing on two sockets.
    default = min(threads, MAX_TCP_CONNECTIONS)
    connections = int_option(opts, OPT_TCP_CONNECTIONS, default, 1, MAX_TCP_CONNECTIONS)
    handshakes = int_option(
        opts, OPT_SERVER_HANDSHAKES, DEFAULT_SERVER_HANDSHAKES, 1, MAX_SERVER_CONNECTIONS
    )
    served = int_option(
        opts,
        OPT_SERVER_CONNECTIONS,
        DEFAULT_SERVER_CONNECTIONS,
        1 + MAX_TCP_CONNECTIONS,
        MAX_SERVER_CONNECTIONS,
    )
    loops = int_option(opts, OPT_SERVER_THREADS, 0, 0, MAX_SERVER_THREADS)
    both_ways = opts.get(OPT_LINKS_BOTH_WAYS, "1") != "0"
    return host, port, token, transport, connections, threads, handshakes, served, loops, both_ways
