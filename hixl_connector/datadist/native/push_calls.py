"""The pushes of ``CacheManager`` (reference section 6.5): ``push_blocks``, ``push_cache``
and ``transfer_cache_async`` on the native engine. A mixin of ``CacheManager``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hixl_connector.datadist.api.llm_types import BlocksCacheKey, Cache, CacheKeyByIdAndIndex
from hixl_connector.datadist.api.rules import (
    DEFAULT_TENSOR_NUM_PER_LAYER,
    PUSH_BLOCKS,
    PUSH_CACHE,
    Transfer,
)
from hixl_connector.datadist.api.status import check_status
from hixl_connector.datadist.native.parity.transfer_async import (
    CacheTask,
    check_transfer_args,
    layer_push,
)
from hixl_connector.datadist.native.transfer_args import PushArgs


def _layer_kwargs(
    src_layer_range: Any, dst_layer_range: Any, tensor_num_per_layer: Any
) -> dict[str, Any]:
    """A push's named layer parameters where the rules read them, as a pull's keywords."""
    return {
        "src_layer_range": src_layer_range,
        "dst_layer_range": dst_layer_range,
        "tensor_num_per_layer": tensor_num_per_layer,
    }


class PushCalls:
    """Needs the host class's ``_engine``, ``_timeout_ms``, ``_remote_cache_accessible``,
    ``_check_is_inited`` and ``_checked``."""

    _engine: Any
    _timeout_ms: int
    _remote_cache_accessible: bool

    _checked: Callable[..., Transfer]  # (call, key, cache, **arguments): a checked Transfer

    def _check_is_inited(self) -> None: ...

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: list[int] | tuple[int, ...] = (),
        dst_blocks: list[int] | tuple[int, ...] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = DEFAULT_TENSOR_NUM_PER_LAYER,
        **kwargs: Any,
    ) -> None:
        """Write local blocks into a linked peer's blocks cache (reference section 6.5):
        ``src_blocks[i]`` of ``src_cache`` lands on ``dst_blocks[i]`` of the peer's cache
        registered under ``dst_cache_key``, for the layers of the ranges (all by default).

        The peer's engine pins its cache and checks every range before a byte lands; on
        the same host it copies the bytes in from this process, over TCP it receives them.
        After a failed push the destination blocks hold undefined content.

        Extension kwarg ``hixl_write_grant`` (int, default 0 = none): the id the peer's
        ``grant_writes`` returned for these blocks; a peer cache registered with
        ``hixl_writes_by_grant`` takes the push only into blocks of exactly that grant
        (write_grants.py), other caches ignore it."""
        layers = _layer_kwargs(src_layer_range, dst_layer_range, tensor_num_per_layer)
        transfer = self._checked(
            PUSH_BLOCKS,
            dst_cache_key,
            src_cache,
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
            kwargs={**kwargs, **layers},
        )
        args = PushArgs.of(transfer)
        status, message = self._engine.push(
            *args.native_args(self._timeout_ms), grant=args.write_grant
        )
        check_status(status, "[push_blocks]", f"dst_cache_key = {dst_cache_key}: {message}")

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = DEFAULT_TENSOR_NUM_PER_LAYER,
    ) -> None:
        """Row ``src_batch_index`` of a local contiguous cache onto the row the key names of
        a linked peer's cache, for the layers of the ranges (all by default). As with
        ``push_blocks``, the peer's engine pins its cache and checks every range first."""
        transfer = self._checked(
            PUSH_CACHE,
            dst_cache_key,
            src_cache,
            batch_index=src_batch_index,
            size=size,
            kwargs=_layer_kwargs(src_layer_range, dst_layer_range, tensor_num_per_layer),
        )
        args = PushArgs.of(transfer)
        status, message = self._engine.push(*args.native_args(self._timeout_ms))
        check_status(status, "[push_cache]", f"dst_cache_key = {dst_cache_key}: {message}")

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: Any,
        transfer_configs: Any,
        src_block_indices: list[int] | tuple[int, ...] | None = None,
        dst_block_indices: list[int] | tuple[int, ...] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Layer-wise push (reference section 6.5): layer by layer, once the synchronizer says
        it is computed, each configuration's layers go to the peer as ``push_blocks`` (a
        blocks cache) or ``push_cache`` (a contiguous one) moves them (transfer_async.py)."""
        self._check_is_inited()
        check_transfer_args(
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            self._remote_cache_accessible,
        )
        pushes = [
            layer_push(self, src_cache, c, src_block_indices, dst_block_indices)
            for c in transfer_configs
        ]
        return CacheTask(transfer_configs, pushes, layer_synchronizer)
