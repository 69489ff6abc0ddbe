"""HixlConnector: the class vLLM instantiates. It only forwards to one of its halves.

role=SCHEDULER -> `HixlScheduler` (EngineCore; pure bookkeeping),
role=WORKER    -> `HixlWorker` (every worker; the engine, the side channel, the pulls).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from hixl_connector.connector import vllm_interface
from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.link_reports import LinkReport
from hixl_connector.connector.mapping.kv_groups import check_movable
from hixl_connector.connector.metadata import HixlConnectorMetadata

KVConnectorMetadata.register(HixlConnectorMetadata)
KVConnectorWorkerMetadata.register(LinkReport)


def _log_where_vllm_logs() -> None:
    """vLLM's logging config gives handlers to its own "vllm" logger only, so the
    connector's INFO lines (links, restarts, shutdown) would reach no one: they go where
    vLLM's go, at vLLM's level (VLLM_LOGGING_LEVEL). Left alone where vLLM configures none
    (VLLM_CONFIGURE_LOGGING=0) or the application configured ours."""
    ours, vllm_logger = logging.getLogger("hixl_connector"), logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level)
    ours.propagate = False


_log_where_vllm_logs()

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hixl_connector.connector.scheduler.half import HixlScheduler
    from hixl_connector.connector.stats import HixlKVConnectorStats, HixlPromMetrics
    from hixl_connector.connector.worker.half import HixlWorker


class HixlConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports the hybrid KV-cache manager: each KV-cache group moves with its own block ids
    (a sliding-window group only the blocks still in its window)."""

    _cache_hit_source = vllm_interface.p2p_cache_hit_source()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No: sleeping releases registered KV memory (config.check_no_sleep_mode)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        """Both back-ends register the KV cache for peers to read and write (HCCL on
        Ascend, the native engine on a host): each segment must stay one allocation. Asked
        by vLLM that has KVCacheAccess (0.34); None before."""
        return vllm_interface.registers_kv_cache()

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        vllm_interface.check_this_vllm(kv_cache_config)
        config = HixlConfig.from_vllm_config(vllm_config)
        check_movable(kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        # Blocks of failed receives, for vLLM that takes them as load errors (get_finished).
        self._failed_receive_blocks: set[int] = set()
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._scheduler: HixlScheduler | None = None
        self._worker: HixlWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from hixl_connector.connector.scheduler.half import HixlScheduler

            self._scheduler = HixlScheduler(vllm_config, config, engine_id, kv_cache_config)
        else:
            from hixl_connector.connector.worker.half import HixlWorker

            self._worker = HixlWorker(vllm_config, config, engine_id, kv_cache_config)

    # -- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return cast(KVConnectorMetadata, self._scheduler.build_connector_meta(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, HixlConnectorMetadata)
        self._worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Reads are whole-request: a synchronous one has landed when start_load_kv returns."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, HixlConnectorMetadata)
            self._worker.bind(connector_metadata)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Push mode, P: writes the layer to the Ds that registered for the forward's
        prompts. Pull mode: nothing (D reads P's blocks)."""
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Nothing waits: P's blocks stay leased until D read them or P wrote them."""
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM with KVConnectorTransferResults: failed receives by request id."""
        assert self._worker is not None
        results = self._worker.get_transfer_results()
        return cast(
            "KVConnectorTransferResults",
            vllm_interface.transfer_results(
                results.finished_sending, results.finished_recving, results.failed_recving
            ),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM without get_transfer_results (vllm_interface): a failed receive is finished,
        and its blocks are load errors of this same step."""
        assert self._worker is not None
        results = self._worker.get_transfer_results()
        self._failed_receive_blocks |= results.failed_blocks
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of synchronous reads that failed (and, where vLLM asks get_finished, of failed
        receives): vLLM recomputes or fails their requests."""
        if self._worker is None:
            return set()
        failed, self._failed_receive_blocks = self._failed_receive_blocks, set()
        return self._worker.take_load_errors() | failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Which P engines this rank now reads in place (link_reports), for the scheduler."""
        if self._worker is None:
            return None
        return cast(KVConnectorWorkerMetadata | None, self._worker.take_link_report())

    def get_kv_connector_stats(self) -> HixlKVConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_stats()
        assert self._scheduler is not None
        misconfigured = self._scheduler.misconfigured.take()
        if not misconfigured:
            return None
        from hixl_connector.connector.stats import HixlKVConnectorStats

        stats = HixlKVConnectorStats()
        for kind, n in misconfigured.items():
            stats.record_misconfigured(kind, n)
        return stats

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- class-level hooks (called in the API-server process too) -----------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HixlKVConnectorStats | None:
        from hixl_connector.connector.stats import HixlKVConnectorStats

        return HixlKVConnectorStats(data=data) if data is not None else HixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HixlPromMetrics:
        from hixl_connector.connector.stats import HixlPromMetrics

        return HixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
