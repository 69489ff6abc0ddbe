"""The worker half: registers the KV caches, pulls on D, leases on P.

D: every RecvSpec becomes one batch on the engine's transfer threads (`receiver.Receiver`),
so vLLM's forward pass never waits on a transfer; `get_transfer_results` collects the finished
ones on the step thread. Every rank reports its results there. The exception is a read in the
step (sync_loads): small, from a P this worker reads in place (a same-host copy, which
waits on no peer; `take_link_report` tells the scheduler which), it lands before the forward
that needs it, and a failure is reported as its blocks (`take_load_errors`).
P: `prefill_serving` answers handshakes and turns D's "done"/"release" notices and lease
expiry into `finished_sending`, so vLLM frees the blocks exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import rank_address
from hixl_connector.connector.kv.layout import KVLayout, describe_kv_caches
from hixl_connector.connector.kv.registered_kv import RegisteredKV, register_kv
from hixl_connector.connector.leases.client import LeaseClient
from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.connector.link_reports import LinkReport, LinkReporter
from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.mapping.kv_groups import (
    check_every_layer_registered,
    group_block_sizes,
)
from hixl_connector.connector.mapping.read_plans import ReadPlans
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.peers.handshake import HandshakePayload
from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path
from hixl_connector.connector.peers.registry import PeerRegistry
from hixl_connector.connector.push.receiver import PushReceiver
from hixl_connector.connector.push.sender import PushSender
from hixl_connector.connector.stats import HixlKVConnectorStats
from hixl_connector.connector.worker.announcement import describe_groups, handshake_payload
from hixl_connector.connector.worker.prefill_serving import PrefillServing
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


@dataclass(frozen=True)
class _Outcome:
    request_id: str
    ok: bool
    block_ids: tuple[int, ...]  # where the KV was to land


@dataclass(frozen=True)
class TransferResults:
    """What ended since the last step. A failed receive is in ``finished_recving`` too;
    ``failed_blocks`` are its blocks (for vLLM that takes failures as load errors)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    failed_blocks: set[int]


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
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._load_errors: set[int] = set()  # blocks of failed synchronous reads, not yet told
        self._load_errors_lock = threading.Lock()
        self._wake = threading.Event()  # a pull ended or a lease may have finished
        self._idle_step = False
        self._stats = HixlKVConnectorStats()
        self._links = LinkReporter(self._tp_rank)
        self._context = zmq.Context()
        self._stats_lock = threading.Lock()  # pool threads record while vLLM collects
        self._kv: RegisteredKV | None = None
        self._layout: KVLayout | None = None
        self._payload: HandshakePayload | None = None
        self._peers: PeerRegistry | None = None
        self._lease_client: LeaseClient | None = None
        self._receiver: Receiver | None = None
        self._push_receiver: PushReceiver | None = None  # D, push mode
        self._serving: PrefillServing | None = None  # P

    # -- registration -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        check_every_layer_registered(self._kv_cache_config, kv_caches)
        num_blocks = int(self._vllm_config.cache_config.num_gpu_blocks or 0)
        # vLLM's CPU layout keeps each KV head of a block contiguous (heads outermost).
        heads = self._vllm_config.model_config.get_num_kv_heads(self._vllm_config.parallel_config)
        head_major = current_platform.device_type == "cpu" and not self._mla
        layout = describe_kv_caches(
            kv_caches,
            num_blocks,
            int(heads) if head_major else 0,
            groups_share_buffers=len(describe_groups(self._kv_cache_config)) > 1,
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
        self._payload = handshake_payload(
            self._vllm_config,
            layout,
            self._engine_id,
            (self._tp_rank, self._tp_size),
            self._address.cluster_id,
            (self._config.engine_host, kv.listen_port),
            self._block_sizes,
            self._kv_cache_config,
        )
        self._peers = PeerRegistry(
            kv.api,
            kv.datadist,
            self._context,
            self._payload,
            self._config,
            kv.reads_in_place,
            self._record,
            self._links,
        )
        plans = ReadPlans(
            self._payload.compatibility, (self._tp_rank, self._tp_size), self._probe_slices
        )
        self._lease_client = LeaseClient(
            self._peers.notice_client,
            self._peers.is_linked,
            plans.notify_targets,
            self._config.heartbeat_s,
            self._tp_rank,
            self._record,
        )
        self._receiver = self.receiver_cls(
            self._config,
            kv,
            layout,
            self._block_sizes,
            plans,
            self._peers,
            self._lease_client,
            self._tp_rank,
            self._record,
            self._record_pull,
            self._finish,
            self._invalidate,
        )
        if self._is_consumer and self._config.transfer_mode == "push":
            self._push_receiver = self.push_receiver_cls(
                self._config,
                kv,
                layout,
                self._block_sizes,
                self._peers,
                self._tp_rank,
                self._address.cluster_id,
                self._record,
                self._record_pull,
                self._finish,
                plans,
            )
        if incarnation is not None and kv.lease_word_memory is not None:
            self._serving = PrefillServing(
                self._context,
                self._config,
                self._address.side_channel_port,
                self._payload,
                (LeaseWords(kv.lease_word_memory), incarnation),
                self._record,
                self._wake.set,
                kv,
                dict(layout.layer_index),
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
        now = time.monotonic()
        pooled = False
        for recv in metadata.to_recv:
            assert self._receiver is not None, "a pull before register_kv_caches"
            pooled |= self._receiver.start(recv, now)
        if self._receiver is not None:
            if any(recv.synchronous for recv in metadata.to_recv):
                self._receiver.settle_sync_loads()  # this step's forward reads their KV
            for request_id in metadata.to_cancel:
                self._receiver.cancel(request_id)
        if pooled:
            # Hands the GIL over so the pool begins its handshakes now rather than when this
            # step next blocks.
            time.sleep(0)
        if self._peers is not None:
            self._peers.close_idle(now)
        if self._lease_client is not None:
            for release in metadata.to_release:
                self._lease_client.notify("release", release)
            self._lease_client.waiting(metadata.waiting, metadata.done_waiting, now)

    @property
    def _pusher(self) -> PushSender | None:
        """P in push mode: what writes into D."""
        return self._serving.pusher if self._serving is not None else None

    def bind(self, metadata: HixlConnectorMetadata) -> None:
        """Before the step's forward, which vLLM 0.32 runs before ``start_load_kv`` (unless
        a load is synchronous): what must not wait a forward starts here. P's lease words
        (cleared, then published: leases.guarded_read), the leases of the prefills the last
        step finished (push mode: their words, which D waits for), and D's push
        registrations (P writes once it has them); pulls start in ``start_load_kv``, as
        vLLM intends."""
        now = time.monotonic()
        if self._serving is not None:
            self._serving.publish(metadata.to_clear, metadata.to_publish)
            self._serving.hold(metadata.to_send)
        if self._pusher is not None:
            self._pusher.not_pushed(metadata.not_pushed)
            self._pusher.computing(metadata.prefilling)
        if self._push_receiver is not None:
            for push in metadata.to_push_recv:
                self._push_receiver.start(push, now)
            for request_id in metadata.to_cancel:
                self._push_receiver.cancel(request_id)

    def save_kv_layer(self, layer_name: str) -> None:
        """The forward computed ``layer_name``: push mode writes it to the Ds waiting."""
        if self._pusher is not None:
            self._pusher.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """The forward ended. Writes go on beside the next steps: P's lease keeps the
        blocks until the last one landed."""
        if self._pusher is not None:
            self._pusher.computed()

    def get_transfer_results(self) -> TransferResults:
        """What ended since the last call."""
        idle = self._idle_step and self._outcomes.empty()
        if self._receiver is not None and self._receiver.in_flight():
            self._receiver.collect(IDLE_STEP_WAIT_S if idle else 0.0)
        elif idle and not self._waited_for_word():
            self._wake.wait(IDLE_STEP_WAIT_S)
        self._wake.clear()
        if self._push_receiver is not None:
            self._push_receiver.collect()
        recving: set[str] = set()
        failed: set[str] = set()
        failed_blocks: set[int] = set()
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                break
            recving.add(outcome.request_id)
            if not outcome.ok:
                failed.add(outcome.request_id)
                failed_blocks.update(outcome.block_ids)
        finished = set() if self._serving is None else self._serving.finished()
        return TransferResults(finished, recving, failed, failed_blocks)

    def _waited_for_word(self) -> bool:
        """Push mode: an idle step waits for P's words (which land straight in memory, so
        a step that slept its wait out would see one up to a wait late); False when no
        request awaits one."""
        receiver = self._push_receiver
        return receiver is not None and receiver.wait_for_word(IDLE_STEP_WAIT_S, self._wake)

    def take_load_errors(self) -> set[int]:
        """Blocks of synchronous reads that failed since the last call: they hold no KV."""
        with self._load_errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_link_report(self) -> LinkReport | None:
        """What this rank learned of its links since the last step, for the scheduler."""
        return self._links.take()

    def get_stats(self) -> HixlKVConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            snapshot, self._stats = self._stats, HixlKVConnectorStats()
            return snapshot

    def _record(self, counter: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.record(counter, n)

    def _record_pull(self, pull_s: float, ready_s: float, nbytes: int, blocks: int) -> None:
        with self._stats_lock:
            self._stats.record_pull(pull_s, ready_s, nbytes, blocks)

    def _finish(self, request_id: str, ok: bool, block_ids: tuple[int, ...]) -> None:
        """A receive ended: reported at the next get_transfer_results, which it wakes."""
        self._outcomes.put(_Outcome(request_id, ok, block_ids))
        self._wake.set()

    def _invalidate(self, block_ids: tuple[int, ...]) -> None:
        with self._load_errors_lock:
            self._load_errors.update(block_ids)

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
        if self._peers is not None:
            self._peers.stop()  # handshakes and notices under way give up at once
        if self._push_receiver is not None:
            self._push_receiver.shutdown()
        if self._receiver is not None and not self._receiver.shutdown(SHUTDOWN_WAIT_S):
            logger.warning("hixl: a handshake still under way at shutdown is abandoned")
        if self._lease_client is not None:
            self._lease_client.shutdown()
        if self._serving is not None:
            self._serving.close()
        if self._peers is not None:
            self._peers.close()
        if self._kv is not None:
            self._kv.datadist.finalize()
            self._kv = None
        # A socket a thread still holds (an abandoned handshake) would make term() wait for
        # it: term in the background, and go on after a bound.
        term = threading.Thread(target=self._context.term, name="hixl-zmq-term", daemon=True)
        term.start()
        term.join(SHUTDOWN_WAIT_S)
        logger.info("hixl: worker shut down in %.2f s", time.monotonic() - began)
