"""The worker half, a composition root: registers the KV caches, then builds the roles this
server plays (``DecodeRole`` on D, ``PrefillRole`` on P, both with kv_both) and routes
vLLM's per-step hooks to them. Both of D's receivers report into one ``Outcomes``.

D: every RecvSpec becomes one batch on the engine's transfer threads (`receiver.Receiver`),
so vLLM's forward pass never waits on a transfer; `get_transfer_results` collects the finished
ones on the step thread. Every rank reports its results there. The exception is a read in the
step (sync_loads): small, from a P this worker reads in place (a same-host copy, which
waits on no peer; `take_link_report` tells the scheduler which), it lands before the forward
that needs it, and a failure is reported as its blocks (`take_load_errors`).
P: `prefill_role` answers handshakes and turns D's "done"/"release" notices and lease
expiry into `finished_sending`, so vLLM frees the blocks exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import rank_address
from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.registered_kv import RegisteredKV, register_kv
from hixl_connector.connector.kv.state_layout import (
    Sharding,
    model_n_groups,
    state_layer_specs,
)
from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.connector.link_reports import LinkReport, LinkReporter
from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.mapping.kv_groups import (
    check_every_layer_registered,
    group_block_sizes,
)
from hixl_connector.connector.mapping.read_plans import ReadPlans
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.outcomes import Outcomes, TransferResults
from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path
from hixl_connector.connector.push.receiver import PushReceiver
from hixl_connector.connector.stats import HixlKVConnectorStats
from hixl_connector.connector.worker.announcement import describe_groups, handshake_payload
from hixl_connector.connector.worker.decode_role import DecodeRole
from hixl_connector.connector.worker.prefill_role import PrefillRole
from hixl_connector.connector.worker.receiver import Receiver

logger = logging.getLogger(__name__)

# vLLM steps in a tight loop while KV sends or receives are pending, even with nothing to
# compute: on a TP engine that keeps every worker busy and can starve the very peer it waits
# for. Such an idle step waits up to this long for a transfer to finish (a finished pull or
# lease wakes it at once), so a new request waits at most this long to be scheduled.
IDLE_STEP_WAIT_S = 0.002
# Shutdown waits this long for a handshake under way on the pool, then for the side-channel
# sockets to close; a worker under load returns within a few seconds whatever its peers do.
SHUTDOWN_WAIT_S = 2.0


class HixlWorker:
    # What reads the KV on D: a subclass may watch or alter reads (the tests' controls).
    receiver_cls: type[Receiver] = Receiver
    push_receiver_cls: type[PushReceiver] = PushReceiver

    def __init__(
        self,
        vllm_config: Any,
        config: HixlConfig,
        engine_id: str,
        kv_cache_config: Any = None,
    ) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._vllm_config = vllm_config
        self._config = config
        self._engine_id = engine_id
        kv_config = vllm_config.kv_transfer_config
        self._is_producer = bool(kv_config.is_kv_producer)
        self._is_consumer = bool(kv_config.is_kv_consumer)
        parallel = vllm_config.parallel_config
        self._tp_size = int(parallel.tensor_parallel_size)
        self._tp_rank = int(get_tensor_model_parallel_rank())
        # The index, not the rank: vLLM resets data_parallel_rank to 0 for dense models.
        self._dp_rank = int(parallel.data_parallel_index)
        self._address = rank_address(config, self._dp_rank, self._tp_rank, self._tp_size)
        self._mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self._kv_cache_config = kv_cache_config
        self._block_sizes = group_block_sizes(vllm_config, kv_cache_config)
        self._outcomes = Outcomes()
        self._idle_step = False
        self._links = LinkReporter(self._tp_rank)
        self._context = zmq.Context()
        self._kv: RegisteredKV | None = None
        self._layout: KVLayout | None = None
        self._decode: DecodeRole | None = None  # built for a kv_consumer
        self._prefill: PrefillRole | None = None  # built for a kv_producer

    # -- registration -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        check_every_layer_registered(self._kv_cache_config, kv_caches)
        num_blocks = int(self._vllm_config.cache_config.num_gpu_blocks or 0)
        # vLLM's CPU layout keeps each KV head of a block contiguous (heads outermost).
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        head_major = current_platform.device_type == "cpu" and not self._mla
        layout = describe_kv_caches(
            kv_caches,
            num_blocks,
            int(heads) if head_major else 0,
            groups_share_buffers=len(describe_groups(self._kv_cache_config)) > 1,
            state_specs=state_layer_specs(self._kv_cache_config),
            sharding=Sharding(self._tp_size, model_n_groups(model.hf_text_config)),
        )
        incarnation = None
        if self._is_producer:  # where P's scheduler writes its start nonce
            path = incarnation_path(self._engine_id, self._dp_rank, self._tp_rank)
            incarnation = IncarnationFile.create(path)
        try:
            kv = register_kv(
                self._config, layout, self._address, self._is_producer, self._is_consumer
            )
        except Exception:
            if incarnation is not None:
                incarnation.unlink()
            raise
        self._kv, self._layout = kv, layout
        payload = handshake_payload(
            self._vllm_config,
            layout,
            self._engine_id,
            (self._tp_rank, self._tp_size),
            self._address.cluster_id,
            (self._config.engine_host, kv.listen_port),
            self._block_sizes,
            self._kv_cache_config,
        )
        if self._is_consumer:
            plans = ReadPlans(
                payload.compatibility, (self._tp_rank, self._tp_size), self._probe_slices
            )
            self._decode = DecodeRole(
                self._config,
                kv,
                layout,
                payload,
                self._context,
                self._block_sizes,
                plans,
                self._links,
                self._outcomes,
                (self.receiver_cls, self.push_receiver_cls),
            )
        if incarnation is not None and kv.lease_word_memory is not None:
            self._prefill = PrefillRole(
                self._context,
                self._config,
                self._address.side_channel_port,
                payload,
                (LeaseWords(kv.lease_word_memory), incarnation),
                self._outcomes.record,
                self._outcomes.wake.set,
                kv,
                dict(layout.layer_index),
                layout.state,
            )
        logger.info(
            "hixl: registered %d KV tensors x %d blocks of %d bytes (cluster %d, rank %d)",
            layout.num_tensors,
            layout.num_blocks,
            layout.block_bytes,
            self._address.cluster_id,
            self._tp_rank,
        )

    # -- per step -----------------------------------------------------------------------

    def start_load_kv(self, metadata: HixlConnectorMetadata) -> None:
        self._idle_step = metadata.idle
        if self._decode is not None:
            self._decode.start_load_kv(metadata, time.monotonic())
        elif metadata.to_recv:
            raise RuntimeError("a pull on a worker that is no kv_consumer")

    def bind(self, metadata: HixlConnectorMetadata) -> None:
        """Before the step's forward, which vLLM 0.32 runs before ``start_load_kv`` (unless
        a load is synchronous): what must not wait a forward starts here. P's lease words
        (cleared, then published: leases.guarded_read), the leases of the prefills the last
        step finished (push mode: their words, which D waits for), and D's push
        registrations (P writes once it has them); pulls start in ``start_load_kv``, as
        vLLM intends."""
        now = time.monotonic()
        if self._prefill is not None:
            self._prefill.bind(metadata)
        if self._decode is not None:
            self._decode.bind(metadata, now)

    def save_kv_layer(self, layer_name: str) -> None:
        if self._prefill is not None:  # push mode writes the layer to the Ds waiting
            self._prefill.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._prefill is not None:
            self._prefill.computed()

    def get_transfer_results(self) -> TransferResults:
        """What ended since the last call. An idle step (nothing to compute, only transfers
        pending) waits up to IDLE_STEP_WAIT_S for one to end instead of spinning."""
        idle = self._idle_step and not self._outcomes.pending()
        wait_s = IDLE_STEP_WAIT_S if idle else 0.0
        wake = self._outcomes.wake
        waited = self._decode is not None and self._decode.collect_reads(wait_s, wake)
        if idle and not waited:
            wake.wait(wait_s)
        wake.clear()
        if self._decode is not None:
            self._decode.collect_pushes()
        finished = set() if self._prefill is None else self._prefill.finished()
        return self._outcomes.results(finished)

    def take_load_errors(self) -> set[int]:
        """Blocks of synchronous reads that failed since the last call: they hold no KV."""
        return self._outcomes.take_load_errors()

    def take_link_report(self) -> LinkReport | None:
        """What this rank learned of its links since the last step, for the scheduler."""
        return self._links.take()

    def get_stats(self) -> HixlKVConnectorStats | None:
        return self._outcomes.take_stats()

    def _probe_slices(self, p_block_size: int) -> tuple[SliceRun, ...]:
        """Where P's blocks land in this rank's larger ones, from the CPU kernels."""
        from hixl_connector.connector.kv.probe import cpu_slice_runs

        assert self._layout is not None
        cache = self._vllm_config.cache_config
        return cpu_slice_runs(
            self._layout.views[0].dtype,
            int(self._vllm_config.model_config.get_head_size()),
            p_block_size,
            int(cache.block_size),
            str(cache.cache_dtype),
        )

    def shutdown(self) -> None:
        began = time.monotonic()
        if self._decode is not None:
            self._decode.stop(SHUTDOWN_WAIT_S)
        if self._prefill is not None:
            self._prefill.close()
        if self._decode is not None:
            self._decode.close()
        if self._kv is not None:
            self._kv.datadist.finalize()
            self._kv = None
        # A socket a thread still holds (an abandoned handshake) would make term() wait for
        # it: term in the background, and go on after a bound.
        term = threading.Thread(target=self._context.term, name="hixl-zmq-term", daemon=True)
        term.start()
        term.join(SHUTDOWN_WAIT_S)
        logger.info("hixl: worker shut down in %.2f s", time.monotonic() - began)
