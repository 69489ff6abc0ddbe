"""Layer-wise push of the LLM-DataDist v2 API: ``LayerSynchronizer``, ``TransferConfig``,
``TransferWithCacheKeyConfig``, ``CacheTask`` and the job behind
``CacheManager.transfer_cache_async``.

The job runs on a thread of its own: for each layer of the source cache it asks the
synchronizer whether the layer is computed, then pushes that layer to every configuration
whose source range holds it. What the native engine moves is what ``push_blocks`` moves;
configurations it cannot serve are refused when the task is created, never half-run.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from hixl_connector.datadist.api.c_types import check_isinstance, check_uint32, check_uint64
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheKeyByIdAndIndex,
    Placement,
)
from hixl_connector.datadist.api.status import (
    LLMException,
    LLMStatusCode,
    raise_if_false,
    raise_if_true,
)

TENSORS_PER_LAYER = 2  # K and V: fixed for transfer_cache_async, as in CANN


def check_layer_range(name: str, layers: Any, allow_none: bool = True) -> None:
    if layers is None and allow_none:
        return
    check_isinstance(name, layers, range, allow_none=False)
    raise_if_false(layers.step == 1, f"check {name}.step == 1 failed")
    raise_if_false(0 <= layers.start < layers.stop, f"check 0 <= {name}.start < stop failed")


class LayerSynchronizer(ABC):
    """Tells a layer-wise push when a layer's KV is computed."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """True once layer ``layer_index`` may be sent; False aborts the task."""


class TransferConfig:
    """A push to raw addresses of a peer (2 per layer: K, V), without remote cache access."""

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: list[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)
        check_isinstance("dst_addrs", dst_addrs, (list, tuple), int, allow_none=False)
        for addr in dst_addrs:
            check_uint64("dst_addrs", addr)
        check_layer_range("src_layer_range", src_layer_range)
        check_uint32("src_batch_index", src_batch_index)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = list(dst_addrs)
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self.dst_cluster_id}, dst_addrs={self.dst_addrs}, "
            f"src_layer_range={self.src_layer_range}, src_batch_index={self.src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """A push to a peer's cache named by its key (remote cache access): the layers of
    ``src_layer_range`` land on those of ``dst_layer_range``, in order."""

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        key_types = (BlocksCacheKey, CacheKeyByIdAndIndex)
        check_isinstance("cache_key", cache_key, key_types, allow_none=False)
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        raise_if_false(
            len(src_layer_range) == len(dst_layer_range),
            f"src_layer_range {src_layer_range} and dst_layer_range {dst_layer_range} differ "
            "in length",
        )
        check_uint32("src_batch_index", src_batch_index)
        raise_if_true(
            isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0,
            "src_batch_index must be 0 with a BlocksCacheKey",
        )
        self.cache_key = cache_key
        self.dst_cluster_id = cache_key.cluster_id
        self.src_layer_range: range | None = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self.cache_key}, src_layer_range="
            f"{self.src_layer_range}, dst_layer_range={self.dst_layer_range}, "
            f"src_batch_index={self.src_batch_index})"
        )


# (src layer, dst layer) -> None; raises LLMException on failure.
LayerPush = Callable[[int, int], None]


def layer_push(
    manager: Any,
    src_cache: Cache,
    config: Any,
    src_block_indices: Any,
    dst_block_indices: Any,
) -> LayerPush:
    """How one configuration's layers move: into a peer's blocks cache with ``push_blocks``
    (a blocks source; without block indices its first block, as in CANN, which moves one
    row of the source per layer), or onto a peer's row with ``push_cache`` (a contiguous
    source). Raw addresses (``TransferConfig``) and ``dst_block_memory_size`` are refused."""
    key = getattr(config, "cache_key", None)
    blocks = isinstance(key, BlocksCacheKey) and src_cache.is_blocks_cache
    rows = isinstance(key, CacheKeyByIdAndIndex) and not src_cache.is_blocks_cache
    raise_if_false(
        isinstance(config, TransferWithCacheKeyConfig)
        and (blocks or rows)
        and not (dst_block_indices and not src_block_indices)
        and not (rows and src_block_indices),
        "transfer_cache_async on the native engine moves a blocks cache into a peer's blocks "
        "cache, or a contiguous cache onto a peer's row (TransferConfig addresses and "
        "dst_block_memory_size are not supported)",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    )
    if rows:

        def push_row(layer: int, dst_layer: int) -> None:
            manager.push_cache(
                key,
                src_cache,
                config.src_batch_index,
                src_layer_range=range(layer, layer + 1),
                dst_layer_range=range(dst_layer, dst_layer + 1),
            )

        return push_row
    src, dst = (
        (list(src_block_indices), list(dst_block_indices)) if src_block_indices else ([0], [0])
    )

    def push_blocks(layer: int, dst_layer: int) -> None:
        manager.push_blocks(
            key,
            src_cache,
            src,
            dst,
            src_layer_range=range(layer, layer + 1),
            dst_layer_range=range(dst_layer, dst_layer + 1),
        )

    return push_blocks


class CacheTask:
    """A running ``transfer_cache_async``. Neither method raises a transfer's failure: it is
    the status they return."""

    def __init__(self, configs: Sequence[Any], pushes: Sequence[LayerPush], sync: Any) -> None:
        self._configs = list(configs)
        self._results: dict[int, LLMStatusCode] = {}
        self._thread = threading.Thread(
            target=self._run, args=(pushes, sync), name="hixl-transfer-cache", daemon=True
        )
        self._thread.start()

    def _run(self, pushes: Sequence[LayerPush], sync: LayerSynchronizer) -> None:
        last = max(c.src_layer_range.stop for c in self._configs)
        for layer in range(last):
            chosen = [i for i, c in enumerate(self._configs) if layer in c.src_layer_range]
            if not chosen:
                continue
            if not sync.synchronize_layer(layer, None):
                for i in chosen:
                    self._results[self._configs[i].dst_cluster_id] = LLMStatusCode.LLM_PARAM_INVALID
                return
            for i in chosen:
                config = self._configs[i]
                offset = layer - config.src_layer_range.start
                try:
                    pushes[i](layer, config.dst_layer_range[offset])
                except LLMException as exc:
                    self._results[config.dst_cluster_id] = exc.status_code
                    return
                if layer == config.src_layer_range.stop - 1:
                    self._results[config.dst_cluster_id] = LLMStatusCode.LLM_SUCCESS

    def _joined(self, timeout_in_millis: int | None) -> bool:
        if timeout_in_millis is not None:
            check_uint32("timeout_in_millis", timeout_in_millis)
        self._thread.join(None if timeout_in_millis is None else timeout_in_millis / 1000)
        return not self._thread.is_alive()

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        if not self._joined(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for config in self._configs:
            code = self._results.get(config.dst_cluster_id)
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        if not self._joined(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._configs)
        return [self._results.get(c.dst_cluster_id) for c in self._configs]


def check_transfer_args(
    src_cache: Any,
    layer_synchronizer: Any,
    transfer_configs: Any,
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    remote_cache_accessible: bool,
) -> int:
    """CANN's checks of ``transfer_cache_async``, in its order; returns the source's layers."""
    check_isinstance("src_cache", src_cache, Cache, allow_none=False)
    raise_if_true(
        src_cache.cache_desc.placement == Placement.HOST, "src cache not support placement HOST"
    )
    for name, indices in (
        ("src_block_indices", src_block_indices),
        ("dst_block_indices", dst_block_indices),
    ):
        check_isinstance(name, indices, (list, tuple), int)
        for index in indices or ():
            check_uint64(name, index)
    if dst_block_memory_size is not None:
        check_uint64("dst_block_memory_size", dst_block_memory_size)
    if src_block_indices:
        raise_if_false(bool(dst_block_indices), "transfer from blocks to cache is not supported")
        raise_if_false(
            len(src_block_indices) == len(dst_block_indices),
            "src_block_indices and dst_block_indices differ in length",
        )
    elif dst_block_indices:
        raise_if_false(
            bool(dst_block_memory_size), "dst_block_memory_size is required with dst_block_indices"
        )
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
    config_type = TransferWithCacheKeyConfig if remote_cache_accessible else TransferConfig
    name = "transfer_configs"
    if remote_cache_accessible:
        name = "While enable_remote_cache_accessible is True, transfer_configs"
    check_isinstance(name, transfer_configs, (list, tuple), config_type, allow_none=False)
    raise_if_true(
        not dst_block_indices and bool(dst_block_memory_size),
        "dst_block_memory_size must be None or 0 without dst_block_indices",
    )
    num_tensors = src_cache.cache_desc.num_tensors
    raise_if_false(
        num_tensors % TENSORS_PER_LAYER == 0,
        f"num_tensors {num_tensors} of the src cache is not a multiple of {TENSORS_PER_LAYER}",
    )
    layers = num_tensors // TENSORS_PER_LAYER
    for config in transfer_configs:
        if config.src_layer_range is None:
            config.src_layer_range = range(layers)
        raise_if_true(
            src_cache.is_blocks_cache and config.src_batch_index != 0,
            "src_batch_index must be 0 for a blocks src cache",
        )
        chosen = config.src_layer_range
        raise_if_false(
            0 <= chosen.start < chosen.stop <= layers,
            f"src_layer_range {chosen} is outside the src cache's {layers} layers",
        )
        if isinstance(config, TransferConfig):
            raise_if_false(
                len(config.dst_addrs) == TENSORS_PER_LAYER * len(chosen),
                f"dst_addrs holds {len(config.dst_addrs)} addresses, "
                f"{TENSORS_PER_LAYER * len(chosen)} expected",
            )
    return layers
