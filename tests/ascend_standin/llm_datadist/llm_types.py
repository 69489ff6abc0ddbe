"""CANN's enums, descriptors and keys (reference sections 2 and 4), as its Python layer
defines them."""

from __future__ import annotations

import math
import socket
from enum import Enum, IntEnum
from typing import Any

from .status import check_isinstance, check_uint, raise_if_false

UINT64_MAX = 2**64 - 1


class LLMRole(IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class DataType(Enum):
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


_ITEM_BYTES = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}


class CacheDesc:
    def __init__(
        self,
        num_tensors: int,
        shape: list[int] | tuple[int, ...],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: Any = None,
    ) -> None:
        check_uint("num_tensors", num_tensors, 32)
        check_isinstance("shape", shape, (list, tuple), int)
        check_isinstance("data_type", data_type, DataType)
        check_isinstance("placement", placement, Placement)
        raise_if_false(0 <= batch_dim_index < len(shape), "batch_dim_index is out of range")
        raise_if_false(-1 <= seq_len_dim_index < len(shape), "seq_len_dim_index is out of range")
        self.num_tensors = num_tensors
        self.shape = list(shape)
        self.data_type = data_type
        self.placement = placement
        self.batch_dim = batch_dim_index
        self.seq_len_dim_index = seq_len_dim_index
        self.kv_tensor_format = kv_tensor_format

    @property
    def batch_size(self) -> int:
        return self.shape[self.batch_dim]

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        return math.prod(self.shape) * _ITEM_BYTES[self.data_type]

    def __repr__(self) -> str:
        return f"CacheDesc({self.num_tensors}, {self.shape}, {self.data_type}, {self.placement})"


class Cache:
    """Made by ``register_*``, never by a user."""

    def __init__(
        self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int], is_blocks: bool
    ) -> None:
        self.cache_id = cache_id
        self.cache_desc = cache_desc
        self.tensor_addrs = tensor_addrs
        self.is_blocks_cache = is_blocks


def _key_args(
    kind: str, names: tuple[str, ...], defaults: dict[str, int], args: Any, kwargs: Any
) -> dict[str, int]:
    """CANN's keys take their ids by position or by name, the first also as ``cluster_id``;
    too many or unknown arguments raise PARAM."""
    raise_if_false(len(args) <= len(names), f"{kind} takes at most {len(names)} arguments")
    values = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        name = names[0] if name == "cluster_id" else name
        raise_if_false(name in names and name not in values, f"{kind}: bad argument {name!r}")
        values[name] = value
    values = {**defaults, **values}
    raise_if_false(all(name in values for name in names), f"{kind}: missing arguments")
    for name in names:
        check_isinstance(name, values[name], int)
    return values


class BlocksCacheKey:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = ("prompt_cluster_id", "model_id")
        values = _key_args("BlocksCacheKey", names, {"model_id": 0}, args, kwargs)
        self.prompt_cluster_id, self.model_id = values["prompt_cluster_id"], values["model_id"]

    @property
    def cluster_id(self) -> int:
        return self.prompt_cluster_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self.cluster_id}, {self.model_id})"


class CacheKey:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = ("prompt_cluster_id", "req_id", "model_id", "prefix_id")
        defaults = {"model_id": 0, "prefix_id": UINT64_MAX}
        values = _key_args("CacheKey", names, defaults, args, kwargs)
        for name in names:
            check_uint(name, values[name], 64)
        self.prompt_cluster_id, self.req_id = values["prompt_cluster_id"], values["req_id"]
        self.model_id, self.prefix_id = values["model_id"], values["prefix_id"]

    @property
    def cluster_id(self) -> int:
        return self.prompt_cluster_id


class CacheKeyByIdAndIndex:
    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint("cluster_id", cluster_id, 64)
        check_isinstance("cache_id", cache_id, int)
        check_uint("batch_index", batch_index, 32)
        self.cluster_id, self.cache_id, self.batch_index = cluster_id, cache_id, batch_index


def _ip_value(ip: Any) -> int:
    """An IPv4 literal as CANN stores it: a little-endian int; anything else raises
    RuntimeError without a status (CANN converts IPv4 literals only)."""
    if isinstance(ip, str) and ip.count(".") == 3:
        try:
            return int.from_bytes(socket.inet_aton(ip), "little")
        except OSError:
            pass
    raise RuntimeError(f"Can not parse ip str:{ip}")


class LLMClusterInfo:
    def __init__(self) -> None:
        self.remote_cluster_id: int | None = None
        self.remote_role_type: LLMRole | None = None
        self.local_ip_info_list: list[tuple[int, int]] = []
        self.remote_ip_info_list: list[tuple[int, int]] = []

    def append_local_ip_info(self, ip: str, port: int) -> None:
        self.local_ip_info_list.append((_ip_value(ip), port))

    def append_remote_ip_info(self, ip: str, port: int) -> None:
        self.remote_ip_info_list.append((_ip_value(ip), port))


def ip_text(value: int) -> str:
    """The dotted form of a stored (little-endian) IPv4 value."""
    return socket.inet_ntoa(value.to_bytes(4, "little"))
