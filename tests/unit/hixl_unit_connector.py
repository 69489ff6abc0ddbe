"""Test-only KV connector: forwards the scheduler-role hooks to HixlScheduler.

vLLM loads it through ``kv_connector_module_path``, so the tests drive HixlScheduler through
vLLM's real Scheduler without the worker half (no torch tensors, sockets or engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.scheduler import HixlScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class HixlConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role != KVConnectorRole.SCHEDULER:
            raise RuntimeError("the unit-test connector has no worker half")
        assert vllm_config.kv_transfer_config is not None
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.hixl = HixlScheduler(vllm_config, HixlConfig.from_vllm_config(vllm_config), engine_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.hixl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.hixl.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.hixl.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.hixl.request_finished(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        self.hixl.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.hixl.update_connector_output(connector_output)

    def get_finished_count(self) -> int | None:
        return self.hixl.get_finished_count()

    # Worker-role hooks: never called, the scheduler role is all these tests build.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
