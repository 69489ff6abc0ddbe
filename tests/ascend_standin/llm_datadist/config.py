"""CANN's ``LlmConfig`` as its Python layer behaves: each option is a property whose setter
checks its type, ``generate_options`` emits the options set (and always
``llm.MemoryUtilization``), and any other attribute (a misspelt option, or one of the native
engine's ``hixl_*`` extensions) is stored on the object and never turned into an option."""

from __future__ import annotations

from typing import Any

from .status import check_isinstance

# Property -> (option key, type): what CANN emits for each option that was set.
_OPTIONS: dict[str, tuple[str, Any]] = {
    "listen_ip_info": ("llm.listenIpInfo", str),
    "sync_kv_timeout": ("llm.SyncKvCacheWaitTime", int),
    "enable_cache_manager": ("llm.EnableCacheManager", bool),
    "enable_remote_cache_accessible": ("llm.EnableRemoteCacheAccessible", bool),
    "enable_switch_role": ("llm.EnableSwitchRole", bool),
    "local_comm_res": ("llm.LocalCommRes", str),
    "transfer_backend": ("llm.TransferBackend", str),
    "global_resource_config": ("llm.GlobalResourceConfig", str),
    "link_total_time": ("llm.LinkTotalTime", int),
    "link_retry_count": ("llm.LinkRetryCount", int),
    "rdma_traffic_class": ("llm.RdmaTrafficClass", int),
    "rdma_service_level": ("llm.RdmaServiceLevel", int),
    "mem_pool_cfg": ("llm.MemPoolConfig", str),
    "host_mem_pool_cfg": ("llm.HostMemPoolConfig", str),
}
MEMORY_UTILIZATION = ("llm.MemoryUtilization", "0.95")


def _option(name: str, kind: Any) -> property:
    def get(self: LLMConfig) -> Any:
        return self._set.get(name)

    def set_(self: LLMConfig, value: Any) -> None:
        check_isinstance(name, value, kind)
        self._set[name] = value

    return property(get, set_)


class LLMConfig:
    def __init__(self) -> None:
        self._set: dict[str, Any] = {}

    device_id = property(
        lambda self: self._set.get("device_id"),
        lambda self, value: self._set.__setitem__("device_id", value),
    )

    def generate_options(self) -> dict[str, str]:
        options: dict[str, str] = {}
        device = self._set.get("device_id")
        if device is not None:
            devices = device if isinstance(device, (list, tuple)) else [device]
            options["ge.exec.deviceId"] = ";".join(str(d) for d in devices)
            options["ge.session_device_id"] = str(devices[0])
        for name, (key, kind) in _OPTIONS.items():
            value = self._set.get(name)
            if value is not None:
                options[key] = ("1" if value else "0") if kind is bool else str(value)
        options[MEMORY_UTILIZATION[0]] = MEMORY_UTILIZATION[1]
        return options

    gen_options = generate_options


for _name, (_key, _kind) in _OPTIONS.items():
    setattr(LLMConfig, _name, _option(_name, _kind))

LlmConfig = LLMConfig
