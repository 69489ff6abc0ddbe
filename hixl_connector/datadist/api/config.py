"""LLMConfig (alias LlmConfig) of the LLM-DataDist v2 API.

``LLMConfig.generate_options()`` yields the option keys of CANN llm_datadist. The project's
native engine adds a few keys of its own, all prefixed ``hixl.`` (see README.md); the ascend
backend drops them before handing the options to CANN.
"""

from __future__ import annotations

from hixl_connector.datadist.api.c_types import (
    UINT32_MAX,
    check_int32,
    check_isinstance,
    check_uint32,
)
from hixl_connector.datadist.api.status import raise_if_false

# Extension option keys understood by the native engine only.
OPT_AUTH_TOKEN = "hixl.authToken"
OPT_TRANSPORT = "hixl.transport"
OPT_TCP_CONNECTIONS = "hixl.tcpConnections"
# A link takes one control and this many data connections of those its peer serves.
MAX_TCP_CONNECTIONS = 16
OPT_TRANSFER_THREADS = "hixl.transferThreads"
MAX_TRANSFER_THREADS = 64
# The listener's caps (connections in the handshake at once, authenticated connections) and
# its event-loop threads; refusals at a cap name its option.
OPT_SERVER_HANDSHAKES = "hixl.serverHandshakes"
OPT_SERVER_CONNECTIONS = "hixl.serverConnections"
OPT_SERVER_THREADS = "hixl.serverThreads"
OPT_WRITES_BY_GRANT = "hixl.writesByGrant"
OPT_LINKS_BOTH_WAYS = "hixl.linksBothWays"
DEFAULT_SERVER_HANDSHAKES = 1024
DEFAULT_SERVER_CONNECTIONS = 4096
MAX_SERVER_CONNECTIONS = 1 << 20
MAX_SERVER_THREADS = 64
TRANSPORTS = ("auto", "cma", "tcp")


def _bool_option(value: bool) -> str:
    return "1" if value else "0"


def check_option_name(config: object, name: str) -> None:
    """CANN's LLMConfig stores any attribute, so a misspelled option (sync_kv_timout) is
    silently never applied; here it is an error naming the options there are."""
    if name.startswith("_") or isinstance(getattr(type(config), name, None), property):
        return
    options = sorted(
        n for cls in type(config).__mro__ for n, v in vars(cls).items() if isinstance(v, property)
    )
    raise AttributeError(f"LLMConfig has no option {name!r}; options: {', '.join(options)}")


class LLMConfig:
    """Typed builder of the options dict passed to ``LLMDataDist.init``.

    Unset properties produce no option key, exactly as in CANN; the engine then applies its
    default (``sync_kv_timeout``: 1000 ms).
    """

    def __init__(self) -> None:
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._listen_ip_info = ""
        self._sync_kv_timeout: int | str | None = None
        self._ge_options: dict[str, str] = {}
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._enable_switch_role = False
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._hixl_auth_token: str | None = None
        self._hixl_transport: str | None = None
        self._hixl_tcp_connections: int | None = None
        self._hixl_transfer_threads: int | None = None
        self._hixl_server_handshakes: int | None = None
        self._hixl_server_connections: int | None = None
        self._hixl_server_threads: int | None = None
        self._hixl_writes_by_grant: bool | None = None
        self._hixl_links_both_ways: bool | None = None

    def __setattr__(self, name: str, value: object) -> None:
        check_option_name(self, name)
        super().__setattr__(name, value)

    # --- CANN options -------------------------------------------------------------------
    @property
    def ge_options(self) -> dict[str, str]:
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_isinstance("ge_options", value, dict)
        for key, item in value.items():
            check_isinstance("ge_options key", key, str, allow_none=False)
            check_isinstance("ge_options value", item, str, allow_none=False)
        self._ge_options = value

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        check_isinstance("device_id", value, (list, tuple, int))
        for dev in value if isinstance(value, (list, tuple)) else [value]:
            check_isinstance("device_id", dev, int, allow_none=False)
            raise_if_false(dev >= 0, "device_id should be greater than or equal to zero.")
            check_int32("device_id", dev)
        self._device_id = value

    @property
    def listen_ip_info(self) -> str:
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_isinstance("listen_ip_info", value, str)
        self._listen_ip_info = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_isinstance("sync_kv_timeout", value, (int, str))
        if isinstance(value, str):
            raise_if_false(value.isdigit(), "sync_kv_timeout must be digit.")
        raise_if_false(int(value) > 0, "sync_kv_timeout should be greater than zero.")
        check_int32("sync_kv_timeout", int(value))
        self._sync_kv_timeout = value

    def _bool_setter(self, name: str, value: bool) -> None:
        check_isinstance(name, value, bool)
        setattr(self, f"_{name}", value)

    @property
    def enable_cache_manager(self) -> bool:
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        self._bool_setter("enable_cache_manager", value)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        self._bool_setter("enable_remote_cache_accessible", value)

    @property
    def enable_switch_role(self) -> bool:
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        self._bool_setter("enable_switch_role", value)

    def _str_setter(self, name: str, value: str) -> None:
        check_isinstance(name, value, str)
        setattr(self, f"_{name}", value)

    local_comm_res = property(
        lambda self: self._local_comm_res or "",
        lambda self, v: self._str_setter("local_comm_res", v),
    )
    transfer_backend = property(
        lambda self: self._transfer_backend or "",
        lambda self, v: self._str_setter("transfer_backend", v),
    )
    global_resource_config = property(
        lambda self: self._global_resource_config or "",
        lambda self, v: self._str_setter("global_resource_config", v),
    )
    mem_pool_cfg = property(
        lambda self: self._mem_pool_cfg, lambda self, v: self._str_setter("mem_pool_cfg", v)
    )
    host_mem_pool_cfg = property(
        lambda self: self._host_mem_pool_cfg,
        lambda self, v: self._str_setter("host_mem_pool_cfg", v),
    )

    @property
    def link_total_time(self) -> int:
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        check_isinstance("link_total_time", value, int)
        raise_if_false(
            0 <= value <= UINT32_MAX,
            f"link_total_time should be an integer between [0, 2^32-1], given value is {value}",
        )
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_isinstance("link_retry_count", value, int)
        raise_if_false(
            1 <= value <= 100,
            f"link_retry_count should be an integer between [1, 100], given value is {value}",
        )
        self._link_retry_count = value

    def _uint32_setter(self, name: str, value: int) -> None:
        check_uint32(name, value)
        setattr(self, f"_{name}", value)

    rdma_traffic_class = property(
        lambda self: self._rdma_traffic_class,
        lambda self, v: self._uint32_setter("rdma_traffic_class", v),
    )
    rdma_service_level = property(
        lambda self: self._rdma_service_level,
        lambda self, v: self._uint32_setter("rdma_service_level", v),
    )

    # --- project extensions (native engine only) --------------------------------------
    @property
    def hixl_auth_token(self) -> str | None:
        """Shared secret for link authentication; env HIXL_AUTH_TOKEN is used when unset."""
        return self._hixl_auth_token

    @hixl_auth_token.setter
    def hixl_auth_token(self, value: str) -> None:
        check_isinstance("hixl_auth_token", value, str, allow_none=False)
        self._hixl_auth_token = value

    @property
    def hixl_transport(self) -> str | None:
        return self._hixl_transport

    @hixl_transport.setter
    def hixl_transport(self, value: str) -> None:
        check_isinstance("hixl_transport", value, str, allow_none=False)
        raise_if_false(
            value in TRANSPORTS, f"hixl_transport must be one of {TRANSPORTS}, got {value!r}"
        )
        self._hixl_transport = value

    @property
    def hixl_writes_by_grant(self) -> bool | None:
        """Blocks caches take pushes only into blocks granted to the pusher (write_grants.py)."""
        return self._hixl_writes_by_grant

    @hixl_writes_by_grant.setter
    def hixl_writes_by_grant(self, value: bool) -> None:
        check_isinstance("hixl_writes_by_grant", value, bool, allow_none=False)
        self._hixl_writes_by_grant = value

    @property
    def hixl_links_both_ways(self) -> bool | None:
        """Off: a link goes one way, and a linker without a listener opens none."""
        return self._hixl_links_both_ways

    @hixl_links_both_ways.setter
    def hixl_links_both_ways(self, value: bool) -> None:
        check_isinstance("hixl_links_both_ways", value, bool, allow_none=False)
        self._hixl_links_both_ways = value

    def _count_setter(self, name: str, value: int, high: int, low: int = 1) -> None:
        check_isinstance(name, value, int, allow_none=False)
        raise_if_false(low <= value <= high, f"{name} must be in [{low}, {high}], got {value}")
        setattr(self, f"_{name}", value)

    hixl_tcp_connections = property(
        lambda self: self._hixl_tcp_connections,
        lambda self, v: self._count_setter("hixl_tcp_connections", v, MAX_TCP_CONNECTIONS),
    )
    hixl_transfer_threads = property(
        lambda self: self._hixl_transfer_threads,
        lambda self, v: self._count_setter("hixl_transfer_threads", v, MAX_TRANSFER_THREADS),
    )
    hixl_server_handshakes = property(
        lambda self: self._hixl_server_handshakes,
        lambda self, v: self._count_setter("hixl_server_handshakes", v, MAX_SERVER_CONNECTIONS),
    )
    hixl_server_connections = property(
        lambda self: self._hixl_server_connections,
        lambda self, v: self._count_setter(
            "hixl_server_connections", v, MAX_SERVER_CONNECTIONS, 1 + MAX_TCP_CONNECTIONS
        ),
    )
    hixl_server_threads = property(
        lambda self: self._hixl_server_threads,
        lambda self, v: self._count_setter("hixl_server_threads", v, MAX_SERVER_THREADS, 0),
    )

    # --- options --------------------------------------------------------------------------
    def generate_options(self) -> dict[str, str]:
        options: dict[str, str] = dict(self._ge_options)
        dev = self._device_id
        if isinstance(dev, int):
            options["ge.exec.deviceId"] = str(dev)
            options["ge.session_device_id"] = str(dev)
        elif dev is not None:
            options["ge.session_device_id"] = str(dev[0])
            options["ge.exec.deviceId"] = ";".join(str(d) for d in dev)
        if self._sync_kv_timeout is not None:
            options["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._mem_pool_cfg:
            options["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            options["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            options["llm.EnableCacheManager"] = _bool_option(self._enable_cache_manager)
        if self._enable_remote_cache_accessible is not None:
            options["llm.EnableRemoteCacheAccessible"] = _bool_option(
                self._enable_remote_cache_accessible
            )
        optional = {
            "llm.listenIpInfo": self._listen_ip_info or None,
            "llm.LinkTotalTime": self._link_total_time,
            "llm.LinkRetryCount": self._link_retry_count,
            "llm.RdmaTrafficClass": self._rdma_traffic_class,
            "llm.RdmaServiceLevel": self._rdma_service_level,
            "llm.LocalCommRes": self._local_comm_res,
            "llm.TransferBackend": self._transfer_backend,
            "llm.GlobalResourceConfig": self._global_resource_config,
            OPT_AUTH_TOKEN: self._hixl_auth_token,
            OPT_TRANSPORT: self._hixl_transport,
            OPT_TCP_CONNECTIONS: self._hixl_tcp_connections,
            OPT_TRANSFER_THREADS: self._hixl_transfer_threads,
            OPT_SERVER_HANDSHAKES: self._hixl_server_handshakes,
            OPT_SERVER_CONNECTIONS: self._hixl_server_connections,
            OPT_SERVER_THREADS: self._hixl_server_threads,
        }
        options.update({key: str(value) for key, value in optional.items() if value is not None})
        if self._enable_switch_role:
            options["llm.EnableSwitchRole"] = "1"
        if self._hixl_writes_by_grant is not None:
            options[OPT_WRITES_BY_GRANT] = _bool_option(self._hixl_writes_by_grant)
        if self._hixl_links_both_ways is not None:
            options[OPT_LINKS_BOTH_WAYS] = _bool_option(self._hixl_links_both_ways)
        return options

    gen_options = generate_options


LlmConfig = LLMConfig
