"""Descriptors and keys of the LLM-DataDist v2 API: DataType, Placement, CacheDesc, Cache and the
three cache keys. Constructors check their arguments the way CANN llm_datadist does. Also
``BlocksPull``, one ``pull_blocks`` call as data (for the project's ``pull_blocks_batch_async``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum, IntEnum
from typing import Any, NamedTuple

from hixl_connector.datadist.api.c_types import (
    INVALID_ID,
    check_int32,
    check_int64,
    check_isinstance,
    check_uint32,
    check_uint64,
)
from hixl_connector.datadist.api.status import LLMException, raise_if_false


class DataType(Enum):
    """GE graph data type numbers."""

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


_ELEMENT_BYTES = {
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


class Placement(IntEnum):
    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """Memory to re-register with ``CacheManager.remap_registered_memory``."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        check_isinstance("addr", addr, int)
        check_isinstance("size", size, int)
        self._mem_type, self._addr, self._size = mem_type, addr, size

    mem_type = property(lambda self: self._mem_type)
    addr = property(lambda self: self._addr)
    size = property(lambda self: self._size)

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class CacheDesc:
    """Shape of one tensor of a cache; a cache holds ``num_tensors`` tensors of that shape.

    For a blocks cache ``shape[batch_dim_index]`` (normally ``shape[0]``) is the number of blocks.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: list[int] | tuple[int, ...],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_uint32("num_tensors", num_tensors)
        check_isinstance("shape", shape, (tuple, list), int)
        check_isinstance("data_type", data_type, DataType)
        check_isinstance("placement", placement, Placement)
        check_isinstance("batch_dim_index", batch_dim_index, int)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(
            0 <= batch_dim_index < len(shape),
            f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})",
        )
        raise_if_false(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in range "
            f"[0, {len(shape)})",
        )
        for dim in shape:
            check_int64("shape", dim)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._batch_size = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    num_tensors = property(lambda self: self._num_tensors)
    shape = property(lambda self: self._shape)
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim)
    batch_size = property(lambda self: self._batch_size)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        element = _ELEMENT_BYTES.get(self._data_type)
        count = 1
        for dim in self._shape:
            count *= dim
        if element is None or count < 0:
            raise LLMException(
                f"Failed to calc tensor size, shape = {self._shape}, data_type = {self._data_type}"
            )
        return count * element

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement}, "
            f"batch_dim_index={self._batch_dim}, seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format})"
        )


class Cache:
    """A registered cache. Created by ``CacheManager.register_*``; users never construct it."""

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        cache_manager: Any,
        is_registered: bool,
        is_blocks_cache: bool,
        remote_accessible: bool = False,
    ) -> None:
        check_int64("cache_id", cache_id)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache
        self._remote_accessible = remote_accessible
        self._valid = True

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    tensor_addrs = property(lambda self: self._tensor_addrs)
    is_blocks_cache = property(lambda self: self._is_blocks_cache)

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, list, int)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        raise_if_false(
            cache_desc.num_tensors == len(addrs),
            f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}",
        )
        return cls(-1, cache_desc, addrs, None, False, True)

    def __repr__(self) -> str:
        return (
            f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = {len(self._tensor_addrs)}, "
            f"is_blocks_cache = {self._is_blocks_cache})"
        )


class KvCache:
    """The v1 API's cache handle: importable as in CANN, never produced by the v2 API."""

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        per_device_tensor_addrs: list[list[int]],
        kv_cache_manager: Any = None,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager
        check_int64("cache_id", cache_id)

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    per_device_tensor_addrs = property(lambda self: self._per_device_tensor_addrs)

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[Any]) -> KvCache:
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs can not be empty")
        check_isinstance("addrs", addrs, list, (list, int))
        nested = isinstance(addrs[0], list)
        raise_if_false(
            all(isinstance(a, list) == nested for a in addrs), "addrs mixes lists and ints"
        )
        rows = addrs if nested else [addrs]
        for row in rows:
            check_isinstance("addrs", row, list, int)
            raise_if_false(
                len(row) == cache_desc.num_tensors,
                f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(row)}",
            )
        return cls(-1, cache_desc, rows, None)

    def __repr__(self) -> str:
        return (
            f"KvCache(cache_id = {self._cache_id}, "
            f"num_devices = {len(self._per_device_tensor_addrs)})"
        )


def _bind_key_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], positional: list[str], limit: int
) -> dict[str, Any]:
    raise_if_false(len(args) + len(kwargs) <= limit, "Param num is over limit")
    bound = dict(kwargs)
    for name, value in zip(positional, args, strict=False):
        bound[name] = value
    raise_if_false(
        "prompt_cluster_id" in bound or "cluster_id" in bound,
        "Param prompt_cluster_id or cluster_id is required",
    )
    allowed = ["prompt_cluster_id", *positional]
    for key in bound:
        raise_if_false(key in allowed, f"Unsupported param:{key}")
    return bound


class BlocksCacheKey:
    """Index of a peer's blocks cache: ``BlocksCacheKey(cluster_id, model_id=0)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind_key_args(args, kwargs, ["cluster_id", "model_id"], 2)
        self._cluster_id_key = "cluster_id" if "cluster_id" in bound else "prompt_cluster_id"
        self._cluster_id = bound[self._cluster_id_key]
        self._model_id = bound.get("model_id", 0)
        check_isinstance("cluster_id", self._cluster_id, int)
        check_isinstance("model_id", self._model_id, int)

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    model_id = property(lambda self: self._model_id)

    def __repr__(self) -> str:
        return (
            f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"
        )


class CacheKey:
    """Index of a peer's contiguous cache row: ``CacheKey(cluster_id, req_id, model_id=0,
    prefix_id=2**64-1)``. Exactly one of req_id / prefix_id must be valid when it is used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind_key_args(args, kwargs, ["cluster_id", "req_id", "model_id", "prefix_id"], 4)
        raise_if_false("req_id" in bound, "Param req_id is required")
        self._cluster_id = bound.get("cluster_id", bound.get("prompt_cluster_id"))
        self._req_id = bound["req_id"]
        self._model_id = bound.get("model_id", 0)
        self._prefix_id = bound.get("prefix_id", INVALID_ID)
        check_uint64("cluster_id", self._cluster_id)
        check_uint64("req_id", self._req_id)
        check_uint64("model_id", self._model_id)
        check_uint64("prefix_id", self._prefix_id)

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    req_id = property(lambda self: self._req_id)
    model_id = property(lambda self: self._model_id)
    prefix_id = property(lambda self: self._prefix_id)

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"prefix_id={self._prefix_id}, model_id={self._model_id})"
        )


class CacheKeyByIdAndIndex:
    """Index of one batch row of a peer's cache by its cache id."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    cluster_id = property(lambda self: self._cluster_id)
    cache_id = property(lambda self: self._cache_id)
    batch_index = property(lambda self: self._batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksPull(NamedTuple):
    """The arguments of one ``pull_blocks`` call, for ``pull_blocks_batch_async``."""

    src_cache_key: Any
    dst_cache: Any
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]
    kwargs: Mapping[str, Any] = {}
