"""Scheduler half of the connector: pure request bookkeeping in the EngineCore process.

vLLM's scheduler-role hooks, routed to D's side (``decode_side``, kv_consumer) and P's side
(``prefill_side``, kv_producer); kv_both has both. Requests that show a misconfigured
deployment are noted here (``misconfig``). No torch, zmq or engine here; the workers do all
I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.link_reports import LinkReport
from hixl_connector.connector.mapping.kv_groups import (
    group_block_sizes,
    group_windows,
    one_group_block_bytes,
)
from hixl_connector.connector.mapping.state_groups import state_groups
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.scheduler.decode_side import DecodeSide, DecodeStep
from hixl_connector.connector.scheduler.misconfig import Misconfigurations
from hixl_connector.connector.scheduler.prefill_side import PrefillSide
from hixl_connector.connector.scheduler.sync_loads import SyncLoads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM's RequestStatus names of a prefill whose KV D may take; by name, since importing
# vllm.v1.request would bring torch into the scheduler half.
DELIVERABLE_STATUSES = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


class HixlScheduler:
    """Scheduler-role hooks of HixlConnector."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: HixlConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        kv_transfer_config = vllm_config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("HixlScheduler needs vllm_config.kv_transfer_config")
        parallel = vllm_config.parallel_config
        tp_size = parallel.tensor_parallel_size
        self._group_block_sizes = group_block_sizes(vllm_config, kv_cache_config)
        push = config.pushes
        states = state_groups(kv_cache_config)
        self.misconfigured = Misconfigurations()
        self.decode: DecodeSide | None = None
        self.prefill: PrefillSide | None = None
        if kv_transfer_config.is_kv_consumer:
            loads = SyncLoads(
                config.sync_load_bytes,
                one_group_block_bytes(kv_cache_config),
                self._group_block_sizes[0],
                tp_size,
            )
            self.decode = DecodeSide(
                loads, self._group_block_sizes, self.misconfigured, push, states
            )
        if kv_transfer_config.is_kv_producer:
            dp_rank = parallel.data_parallel_index
            # As many lease slots as P's workers allocated lease words: one per block.
            num_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0) or int(
                getattr(kv_cache_config, "num_blocks", 0)
            )
            self.prefill = PrefillSide(
                config,
                engine_id,
                dp_rank,
                tp_size,
                self._group_block_sizes,
                num_blocks,
                group_windows(kv_cache_config),
                states,
                # vLLM resolves the hash block size after it built the connector (0.34).
                lambda: _block_hashes(vllm_config, kv_cache_config),
            )

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        request_id = request.request_id
        if params.get("do_remote_decode"):
            if self.prefill is None:
                self.misconfigured.note("consumer_asked_to_produce", request_id)
            else:
                self.prefill.follow(request)
        if self.decode is not None and self.prefill is None and not params:
            self.misconfigured.note("decode_without_params", request_id)
        if not params.get("do_remote_prefill"):
            return
        if self.decode is None:
            self.misconfigured.note("producer_asked_to_consume", request_id)
            return
        self.decode.on_new_request(request_id, params)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._wants_remote_prefill(request) and self.decode is not None:
            return self.decode.get_num_new_matched_tokens(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self._wants_remote_prefill(request) and self.decode is not None and params:
            self.decode.update_state_after_alloc(request, params, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.decode is not None:
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(report, LinkReport):
                self.decode.report(report)
            for request_id in connector_output.finished_recving or ():
                self.decode.finished_recving(request_id)
        if self.prefill is not None:
            for request_id in connector_output.finished_sending or ():
                self.prefill.finished_sending(request_id)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid KV-cache manager: one KV-cache group."""
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.decode is not None and self.decode.request_finished(request):
            return False, None
        params = request.kv_transfer_params
        if self.prefill is None or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status.name not in DELIVERABLE_STATUSES:
            self.prefill.drop(request.request_id)
            return False, None
        if len(block_ids) != len(self._group_block_sizes):
            raise ValueError(
                f"request {request.request_id} has {len(block_ids)} KV-cache groups, this "
                f"engine {len(self._group_block_sizes)}"
            )
        return self.prefill.lease(request, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HixlConnectorMetadata:
        step = (
            self.decode.take_step()
            if self.decode is not None
            else DecodeStep([], [], [], [], [], [])
        )
        clears, publications = (
            self.prefill.step(scheduler_output) if self.prefill is not None else ([], [])
        )
        return HixlConnectorMetadata(
            to_recv=step.to_recv,
            to_push_recv=step.to_push_recv,
            to_release=step.to_release,
            to_send=self.prefill.take_sends() if self.prefill is not None else [],
            to_clear=clears,
            to_publish=publications,
            prefilling=self.prefill.prefilling(scheduler_output) if self.prefill else [],
            not_pushed=self.prefill.take_not_pushed() if self.prefill else [],
            to_cancel=step.to_cancel,
            waiting=step.waiting,
            done_waiting=step.done_waiting,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )

    def get_finished_count(self) -> int | None:
        # Every worker rank reports every request it took part in: the world size.
        return None

    @staticmethod
    def _wants_remote_prefill(request: Request) -> bool:
        params = request.kv_transfer_params
        return bool(params and params.get("do_remote_prefill"))


def _block_hashes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int] | None:
    """(hash block size, lookahead tokens) of a vLLM whose requests drop the block hashes
    of tokens they lose (0.34: ``truncate_block_hashes``); None where it has no hash block
    size of its own."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    if not size:
        return None
    return int(size), int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
