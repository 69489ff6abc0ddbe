"""A checked transfer (``api.rules``) in the form the native engine's ``pull``, ``pull_cache``
and ``push`` take it. Pure: no engine, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hixl_connector.datadist.api.c_types import to_int64
from hixl_connector.datadist.api.llm_types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from hixl_connector.datadist.api.rules import (
    WRITE_GRANT_KWARG,
    Transfer,
    layer_tensors,
    push_layers,
)

# Values of the native engine's remote_kind argument.
KIND_BLOCKS = 0
KIND_CACHE_ID = 1
KIND_CACHE_KEY = 2


@dataclass(frozen=True)
class RemoteKey:
    """The peer's cache as the native engine names it: blocks by (cluster, model), a row by
    cache id and batch index, or a row by request or prefix key."""

    cluster_id: int
    kind: int
    model_id: int = 0
    cache_id: int = -1
    req_id: int = -1
    prefix_id: int = -1
    batch_index: int = 0

    @classmethod
    def of(cls, key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> RemoteKey:
        if isinstance(key, BlocksCacheKey):
            return cls(key.cluster_id, KIND_BLOCKS, model_id=key.model_id)
        if isinstance(key, CacheKeyByIdAndIndex):
            return cls(
                key.cluster_id, KIND_CACHE_ID, cache_id=key.cache_id, batch_index=key.batch_index
            )
        return cls(
            key.cluster_id, KIND_CACHE_KEY, key.model_id, req_id=key.req_id, prefix_id=key.prefix_id
        )

    def native_args(self) -> tuple[int, ...]:
        """The leading arguments of the native ``pull`` and ``pull_cache``; ids CANN types
        uint64 go as the int64 the engine stores."""
        return (
            to_int64(self.cluster_id),
            self.kind,
            to_int64(self.model_id),
            self.cache_id,
            to_int64(self.req_id),
            to_int64(self.prefix_id),
            self.batch_index,
        )


@dataclass(frozen=True)
class PullArgs:
    """A checked ``pull_blocks`` (the block lists) or ``pull_cache`` (the local row and the
    bytes of each tensor, -1 for the whole row)."""

    remote: RemoteKey
    local_cache_id: int
    what: tuple[Any, Any]  # (src_blocks, dst_blocks), or (local batch index, size)
    src_tensors: tuple[int, int]  # (first, count); count -1 = every tensor
    dst_tensors: tuple[int, int]

    @classmethod
    def of(cls, t: Transfer) -> PullArgs:
        n = t.tensor_num_per_layer
        return cls(
            RemoteKey.of(t.key),
            t.cache.cache_id,
            (t.src_blocks, t.dst_blocks) if t.call.blocks else (t.batch_index, t.size),
            layer_tensors(t.layer_range("src_layer_range"), n),
            layer_tensors(t.layer_range("dst_layer_range"), n),
        )

    @property
    def remote_cluster_id(self) -> int:
        return self.remote.cluster_id

    def native_args(self, timeout_ms: int) -> tuple[Any, ...]:
        """The native ``pull``'s (blocks) or ``pull_cache``'s (a row) positional arguments."""
        return (
            *self.remote.native_args(),
            self.local_cache_id,
            *self.what,
            *self.src_tensors,
            *self.dst_tensors,
            timeout_ms,
        )


@dataclass(frozen=True)
class PushArgs:
    """A checked ``push_blocks`` or ``push_cache``: the local blocks (or row) onto the
    peer's, for the same number of tensors on both sides."""

    remote: RemoteKey
    src_cache_id: int
    src_blocks: list[int] | tuple[int, ...]
    dst_blocks: list[int] | tuple[int, ...]
    src_first_tensor: int
    dst_first_tensor: int
    tensor_count: int
    src_batch_index: int = 0
    write_grant: int = 0

    @classmethod
    def of(cls, t: Transfer) -> PushArgs:
        n = t.tensor_num_per_layer
        src_layers, dst_layers = push_layers(t)
        return cls(
            RemoteKey.of(t.key),
            t.cache.cache_id,
            t.src_blocks,
            t.dst_blocks,
            src_layers.start * n,
            dst_layers.start * n,
            len(src_layers) * n,
            t.batch_index,
            t.kwargs.get(WRITE_GRANT_KWARG, 0),
        )

    @property
    def remote_cluster_id(self) -> int:
        return self.remote.cluster_id

    def native_args(self, timeout_ms: int) -> tuple[Any, ...]:
        """The native ``push``'s positional arguments; ``write_grant`` goes as ``grant=``.
        A row push names the peer's row by cache id and batch index after the timeout."""
        r = self.remote
        head = (to_int64(r.cluster_id), to_int64(r.model_id) if r.kind == KIND_BLOCKS else -1)
        ranges = (
            self.src_cache_id,
            self.src_blocks,
            self.dst_blocks,
            self.src_first_tensor,
            self.tensor_count,
            self.dst_first_tensor,
            self.tensor_count,
            timeout_ms,
        )
        if r.kind == KIND_BLOCKS:
            return (*head, *ranges)
        return (*head, *ranges, KIND_CACHE_ID, r.cache_id, r.batch_index, self.src_batch_index)
