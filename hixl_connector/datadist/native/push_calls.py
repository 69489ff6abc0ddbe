"""The pushes of ``CacheManager`` (reference section 6.5): ``push_blocks``, ``push_cache``
and ``transfer_cache_async`` on the native engine, and push_blocks' argument checks, in
pull_blocks' order where they share one. A mixin of ``CacheManager``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hixl_connector.datadist.api.checks import INT64_MAX, check_isinstance, to_int64
from hixl_connector.datadist.api.llm_types import BlocksCacheKey, Cache, CacheKeyByIdAndIndex
from hixl_connector.datadist.api.status import (
    LLMStatusCode,
    check_status,
    raise_if_false,
    raise_if_true,
)
from hixl_connector.datadist.api.validation import (
    DEFAULT_TENSOR_NUM_PER_LAYER,
    check_block_ids,
    check_block_list,
    check_kwargs,
    push_layer_ranges,
)
from hixl_connector.datadist.native.parity.cache_rows import validate_push_cache
from hixl_connector.datadist.native.parity.transfer_async import (
    CacheTask,
    check_transfer_args,
    layer_push,
)

# push_blocks' extension keyword arguments (not in CANN's API).
PUSH_BLOCKS_KWARGS = ("hixl_write_grant",)


@dataclass(frozen=True)
class PushArgs:
    """A validated push, in the form the native engine takes it."""

    remote_cluster_id: int
    model_id: int
    src_cache_id: int
    src_blocks: list[int] | tuple[int, ...]
    dst_blocks: list[int] | tuple[int, ...]
    src_tensor_first: int
    src_tensor_count: int
    dst_tensor_first: int
    dst_tensor_count: int
    write_grant: int = 0

    def native_args(self, timeout_ms: int) -> tuple[Any, ...]:
        """The native ``push``'s positional arguments; ``write_grant`` goes as ``grant=``."""
        return (
            to_int64(self.remote_cluster_id),
            to_int64(self.model_id),
            self.src_cache_id,
            self.src_blocks,
            self.dst_blocks,
            self.src_tensor_first,
            self.src_tensor_count,
            self.dst_tensor_first,
            self.dst_tensor_count,
            timeout_ms,
        )


def check_write_grant(value: Any) -> int:
    """The ``hixl_write_grant`` extension: a grant id of the destination's ``grant_writes``
    (ids are in [1, 2**63)), or 0 for none. ``TypeError`` for anything but an int (a bool
    too), ``LLM_PARAM_INVALID`` outside [0, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"hixl_write_grant only support ['int'], but got {type(value)}.")
    raise_if_false(
        0 <= value <= INT64_MAX,
        f"hixl_write_grant {value} is out of range [0, 2**63)",
    )
    return value


def validate_push_blocks(
    dst_cache_key: Any,
    src_cache: Any,
    src_blocks: Any,
    dst_blocks: Any,
    src_layer_range: Any,
    dst_layer_range: Any,
    tensor_num_per_layer: Any,
    registered: dict[int, Cache],
    kwargs: dict[str, Any] | None = None,
) -> PushArgs:
    """push_blocks' checks (reference section 6.5), in pull_blocks' order where they share one.
    ``registered``: this process's live caches by id; ``kwargs``: the extension keyword
    arguments (PUSH_BLOCKS_KWARGS)."""
    extensions = kwargs or {}
    check_kwargs("push_blocks", extensions, PUSH_BLOCKS_KWARGS)
    write_grant = check_write_grant(extensions.get("hixl_write_grant", 0))
    check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
    check_isinstance("src_cache", src_cache, Cache, allow_none=False)
    check_block_list("src_blocks", src_blocks)
    check_block_list("dst_blocks", dst_blocks)
    raise_if_false(
        src_cache.is_blocks_cache, "param check failed, src_cache should be blocks cache."
    )
    raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
    raise_if_false(len(src_blocks) > 0, "src_blocks can not be empty.")
    src_layers, dst_layers = push_layer_ranges(
        "push_blocks", src_cache, tensor_num_per_layer, src_layer_range, dst_layer_range
    )
    check_block_ids("src_blocks", src_blocks)
    check_block_ids("dst_blocks", dst_blocks)
    raise_if_false(
        registered.get(src_cache.cache_id) is src_cache,
        f"local cache {src_cache.cache_id} does not exist (unregistered or from another engine)",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )
    num_blocks = src_cache.cache_desc.batch_size
    bad = [b for b in src_blocks if b >= num_blocks]
    raise_if_true(
        bool(bad),
        f"src block id {bad[0] if bad else 0} out of range [0, {num_blocks}) of cache "
        f"{src_cache.cache_id}",
    )
    raise_if_true(
        len(src_blocks) != len(dst_blocks),
        f"src_blocks size {len(src_blocks)} != dst_blocks size {len(dst_blocks)}",
    )
    raise_if_true(
        max(dst_blocks) > INT64_MAX,
        f"dst block id {max(dst_blocks)} is out of range of any cache",
    )
    num_tensors = src_cache.cache_desc.num_tensors
    count = len(src_layers) * tensor_num_per_layer
    raise_if_true(
        src_layers.start * tensor_num_per_layer + count > num_tensors,
        f"src_layer_range {src_layers} with tensor_num_per_layer {tensor_num_per_layer} is "
        f"out of range of cache {src_cache.cache_id} ({num_tensors} tensors)",
    )
    return PushArgs(
        remote_cluster_id=dst_cache_key.cluster_id,
        model_id=dst_cache_key.model_id,
        src_cache_id=src_cache.cache_id,
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
        src_tensor_first=src_layers.start * tensor_num_per_layer,
        src_tensor_count=count,
        dst_tensor_first=dst_layers.start * tensor_num_per_layer,
        dst_tensor_count=count,
        write_grant=write_grant,
    )


class PushCalls:
    """Needs the host class's ``_engine``, ``_caches``, ``_timeout_ms``,
    ``_remote_cache_accessible`` and ``_check_is_inited``."""

    _engine: Any
    _caches: dict[int, Cache]
    _timeout_ms: int
    _remote_cache_accessible: bool

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
        self._check_is_inited()
        raise_if_false(
            self._remote_cache_accessible,
            "push_blocks needs enable_remote_cache_accessible (llm.EnableRemoteCacheAccessible)",
        )
        args = validate_push_blocks(
            dst_cache_key,
            src_cache,
            src_blocks,
            dst_blocks,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
            self._caches,
            kwargs,
        )
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
        self._check_is_inited()
        raise_if_false(
            self._remote_cache_accessible,
            "push_cache is only supported while enable_remote_cache_accessible is True",
        )
        row = validate_push_cache(
            dst_cache_key,
            src_cache,
            src_batch_index,
            src_layer_range,
            dst_layer_range,
            size,
            tensor_num_per_layer,
            self._caches,
        )
        status, message = self._engine.push(*row.push_args(self._timeout_ms))
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
