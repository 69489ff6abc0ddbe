"""The worker half: registers the KV caches, pulls on D, leases on P.

D: every RecvSpec becomes one batch on the engine's transfer threads (`receiver.Receiver`),
so vLLM's forward pass never waits on a transfer; `get_transfer_results` collects the finished
ones on the step thread. Every rank reports its results there. The exception is a read in the
step (in_step_loads): small, from a P this worker reads in place (a same-host copy, which
waits on no peer; `take_link_report` tells the scheduler which), it lands before the forward
that needs it, and a failure is reported as its blocks (`take_load_errors`).
P: a side-channel server answers handshakes, and `lease_server.LeaseServer` turns D's
"done"/"release" notices and lease expiry into `finished_sending`, so vLLM frees the blocks
exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from hixl_connector.connector.block_slices import SliceRun
from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.engine_setup import Engine, open_engine
from hixl_connector.connector.handshake import SCHEMA_VERSION, HandshakePayload, compatibility_hash
from hixl_connector.connector.kv_groups import check_every_layer_registered, group_block_sizes
from hixl_connector.connector.kv_layout import KVLayout, describe_kv_caches
from hixl_connector.connector.lease_client import LeaseClient
from hixl_connector.connector.lease_server import LeaseServer
from hixl_connector.connector.lease_words import LeaseWords, words_path
from hixl_connector.connector.link_reports import LinkReport, LinkReporter
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.peers import PeerRegistry
from hixl_connector.connector.rank_addresses import rank_address
from hixl_connector.connector.read_plans import ReadPlans
from hixl_connector.connector.receiver import Receiver
from hixl_connector.connector.side_channel import SideChannelServer
from hixl_connector.connector.side_channel_envelope import Destination
from hixl_connector.connector.stats import HixlKVConnectorStats

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
        model = vllm_config.model_config
        self._num_kv_heads = int(model.get_total_num_kv_heads())
        self._mla = bool(getattr(model, "use_mla", False))
        self._kv_cache_config = kv_cache_config
        self._kv_cache_groups = _describe_groups(kv_cache_config)
        self._block_sizes = group_block_sizes(vllm_config, kv_cache_config)
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._load_errors: set[int] = set()  # blocks of failed in-step reads, not yet told
        self._load_errors_lock = threading.Lock()
        self._wake = threading.Event()  # a pull ended or a lease may have finished
        self._idle_step = False
        self._stats = HixlKVConnectorStats()
        self._links = LinkReporter(self._tp_rank)
        self._context = zmq.Context()
        self._stats_lock = threading.Lock()  # pool threads record while vLLM collects
        self._engine: Engine | None = None
        self._layout: KVLayout | None = None
        self._payload: HandshakePayload | None = None
        self._peers: PeerRegistry | None = None
        self._notices: LeaseClient | None = None
        self._receiver: Receiver | None = None
        self._words: LeaseWords | None = None  # P: this rank's lease words
        self._leases: LeaseServer | None = None  # P: their leases
        self._server: SideChannelServer | None = None

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
            groups_share_buffers=len(self._kv_cache_groups) > 1,
        )
        if self._is_producer:  # one slot per lease, and a lease holds a block at least
            path = words_path(self._engine_id, self._dp_rank, self._tp_rank)
            self._words = LeaseWords.create(path, num_blocks)
        words = (self._words.address, self._words.slots) if self._words else None
        try:
            engine = open_engine(
                self._config, layout, self._address, self._is_producer, self._is_consumer, words
            )
        except Exception:
            if self._words is not None:
                self._words.unlink()
            raise
        self._engine, self._layout = engine, layout
        self._payload = self._handshake_payload(layout, engine.listen_port)
        self._peers = PeerRegistry(
            engine.api,
            engine.datadist,
            self._context,
            self._payload,
            self._config,
            engine.reads_in_place,
            self._record,
        )
        plans = ReadPlans(
            self._payload.compatibility, (self._tp_rank, self._tp_size), self._probe_slices
        )
        self._notices = LeaseClient(
            self._peers.notice_client,
            self._peers.is_linked,
            plans.notify_targets,
            self._config.heartbeat_s,
            self._tp_rank,
            self._record,
        )
        self._receiver = self.receiver_cls(
            self._config,
            engine,
            layout,
            self._block_sizes,
            plans,
            self._peers,
            self._notices,
            self._links,
            self._tp_rank,
            self._record,
            self._record_pull,
            self._finish,
            self._invalidate,
        )
        if self._words is not None:
            self._leases = LeaseServer(
                self._config.lease_s, self._words, self._record, self._wake.set
            )
            self._server = SideChannelServer(
                self._context,
                self._config.side_channel_host,
                self._address.side_channel_port,
                {"handshake": self._on_handshake, **self._leases.handlers()},
                self._identity,
                self._config.auth_token,
            )
        logger.info(
            "hixl: registered %d KV tensors x %d blocks of %d bytes (cluster %d, rank %d)",
            layout.num_tensors,
            layout.num_blocks,
            layout.block_bytes,
            self._address.cluster_id,
            self._tp_rank,
        )

    def _kv_split(self, layout: KVLayout) -> str:
        if self._mla:
            return "replicated"
        return "heads" if layout.head_major else "none"

    def _handshake_payload(self, layout: KVLayout, engine_port: int) -> HandshakePayload:
        model = self._vllm_config.model_config
        block_size = int(self._vllm_config.cache_config.block_size)
        fields = {
            "model": str(model.model),
            "kv_layout": _kv_layout_name(layout, block_size),
            "kv_split": self._kv_split(layout),
            "num_kv_heads": self._num_kv_heads,
            "head_size": int(model.get_head_size()),
            "kv_cache_dtype": str(self._vllm_config.cache_config.cache_dtype),
            "kv_cache_groups": self._kv_cache_groups,
            **layout.compatibility_fields(block_size),
        }
        return HandshakePayload(
            schema_version=SCHEMA_VERSION,
            compatibility_hash=compatibility_hash(fields),
            compatibility=fields,
            engine_id=self._engine_id,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            cluster_id=self._address.cluster_id,
            engine_host=self._config.engine_host,
            engine_port=engine_port,
            num_blocks=layout.num_blocks,
            units_per_block=layout.units_per_block,
            block_sizes=list(self._block_sizes),
            slice_bytes=layout.slice_bytes,
            incarnation=0,  # this start's nonce, announced once P's scheduler wrote it
        )

    # -- per step -----------------------------------------------------------------------

    def start_load_kv(self, metadata: HixlConnectorMetadata) -> None:
        self._idle_step = metadata.idle
        now = time.monotonic()
        if self._leases is not None:
            self._leases.start(metadata.to_send, now)
        pooled = False
        for recv in metadata.to_recv:
            assert self._receiver is not None, "a pull before register_kv_caches"
            pooled |= self._receiver.start(recv, now)
        if self._receiver is not None:
            if any(recv.in_step for recv in metadata.to_recv):
                self._receiver.settle_in_step()  # this step's forward reads their KV
            for request_id in metadata.to_cancel:
                self._receiver.cancel(request_id)
        if pooled:
            # Hands the GIL over so the pool begins its handshakes now rather than when this
            # step next blocks.
            time.sleep(0)
        if self._notices is not None:
            for release in metadata.to_release:
                self._notices.release_later(release)
            self._notices.heartbeats(metadata.heartbeats, now)

    def get_transfer_results(self) -> TransferResults:
        """What ended since the last call."""
        idle = self._idle_step and self._outcomes.empty()
        if self._receiver is not None and self._receiver.in_flight():
            self._receiver.collect(IDLE_STEP_WAIT_S if idle else 0.0)
        elif idle:
            self._wake.wait(IDLE_STEP_WAIT_S)
        self._wake.clear()
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
        finished = set() if self._leases is None else self._leases.finished(time.monotonic())
        return TransferResults(finished, recving, failed, failed_blocks)

    def take_load_errors(self) -> set[int]:
        """Blocks of in-step reads that failed since the last call: they hold no KV."""
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
        from hixl_connector.connector.kv_probe import cpu_slice_runs

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
        if self._receiver is not None and not self._receiver.shutdown(SHUTDOWN_WAIT_S):
            logger.warning("hixl: a handshake still under way at shutdown is abandoned")
        if self._notices is not None:
            self._notices.shutdown()
        if self._server is not None:
            self._server.close()
        if self._peers is not None:
            self._peers.close()
        if self._engine is not None:
            self._engine.datadist.finalize()
            self._engine = None
        if self._words is not None:
            self._words.unlink()  # normally gone already: the scheduler unlinks it
        # A socket a thread still holds (an abandoned handshake) would make term() wait for
        # it: term in the background, and go on after a bound.
        term = threading.Thread(target=self._context.term, name="hixl-zmq-term", daemon=True)
        term.start()
        term.join(SHUTDOWN_WAIT_S)
        logger.info("hixl: worker shut down in %.2f s", time.monotonic() - began)

    # -- P side handlers (side-channel thread) ------------------------------------------

    def _on_handshake(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._payload is not None
        if message.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"peer speaks schema {message.get('schema')!r}, this engine {SCHEMA_VERSION}"
            )
        # The side channel served it only if it names this rank and incarnation.
        return {"payload": {**self._payload.to_dict(), "incarnation": self._identity().incarnation}}

    def _identity(self) -> Destination:
        """What a request to this P rank's side channel must name (incarnation 0 until P's
        scheduler wrote it: then every request is refused as too early)."""
        assert self._words is not None
        return Destination(self._engine_id, self._tp_rank, self._words.incarnation)


def _describe_groups(kv_cache_config: Any) -> list[str]:
    """Each KV-cache group as "<spec>:<sliding window>:<layers>": both sides must agree,
    since a group's block ids index the same layers' bytes on both (block sizes travel
    apart: P's may be smaller)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [
        f"{type(group.kv_cache_spec).__name__}:"
        f"{getattr(group.kv_cache_spec, 'sliding_window', None)}:{len(group.layer_names)}"
        for group in groups
    ]


def _kv_layout_name(layout: KVLayout, block_size: int) -> str:
    """Names what decides the bytes inside a block: the platform, its kernels, the shape of
    a unit with its token dimension as "B" (block sizes may differ)."""
    import torch
    from vllm.platforms import current_platform

    kernels = current_platform.device_type
    if kernels == "cpu":  # the CPU attention kernels pack blocks per ISA
        kernels += ":" + torch.backends.cpu.get_cpu_capability()
    # The shape of one registered unit: a KV head of a block where heads split.
    unit_shape = list(layout.block_shape[1:] if layout.head_major else layout.block_shape)
    dims = [str(d) for d in unit_shape]
    if block_size in unit_shape:
        dims[unit_shape.index(block_size)] = "B"
    return f"{kernels}/{layout.tensors_per_layer}x[{'x'.join(dims)}]"
