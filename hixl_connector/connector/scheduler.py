"""Scheduler half of the connector: pure request bookkeeping in the EngineCore process.

D side (kv_consumer): asks vLLM for the remote tokens, asynchronously or, for a small read
that every worker reads in place, in the step that computes the first token (in_step_loads,
fed by the workers' link_reports); turns each
allocation into one RecvSpec (or a ReleaseSpec when there is nothing to pull) and lists the
remote requests that still wait so the worker can renew P's leases.
P side (kv_producer): keeps a finished prefill's blocks (delay-free), leases them under a
fresh lease id, publishes the lease in a lease word (lease_words) and answers with the
kv_transfer_params D needs.
kv_both enables both. No torch, zmq or engine here; the worker does all I/O.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.blocks import NULL_BLOCK_ID, blocks_for_tokens
from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.in_step_loads import InStepLoads
from hixl_connector.connector.kv_groups import (
    blocks_to_fill,
    group_block_sizes,
    one_group_block_bytes,
    remote_blocks_to_read,
)
from hixl_connector.connector.lease_words import LeaseWords, lease_word, words_path
from hixl_connector.connector.link_reports import LinkReport
from hixl_connector.connector.metadata import (
    OWN_PARAMS,
    UNKNOWN_ENDPOINT,
    HixlConnectorMetadata,
    InvalidTransferParams,
    RecvSpec,
    ReleaseSpec,
    RemoteEndpoint,
    RemotePrefill,
    SendSpec,
    build_remote_decode_params,
    parse_remote_prefill,
)
from hixl_connector.connector.misconfig import Misconfigurations
from hixl_connector.connector.rank_addresses import rank_address

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LEASE_ID_MODULUS = 2**64
# vLLM's RequestStatus names of a prefill whose KV D may take; by name, since importing
# vllm.v1.request would bring torch into the scheduler half.
DELIVERABLE_STATUSES = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


class HixlScheduler:
    """Scheduler-role hooks of HixlConnector.

    Protocol errors on D (params that cannot drive a pull, or P offering fewer blocks than
    D allocated) are never turned into a silent local recompute: the request still parks
    in WAITING_FOR_REMOTE_KVS and gets a RecvSpec with ``error`` set and no remote blocks,
    which the worker reports as failed_recving, so vLLM's kv_load_failure_policy decides.
    """

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
        self._is_producer = kv_transfer_config.is_kv_producer
        self._is_consumer = kv_transfer_config.is_kv_consumer
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._group_block_sizes = group_block_sizes(vllm_config, kv_cache_config)
        dp_rank = parallel.data_parallel_index
        self._engine_id, self._dp_rank = engine_id, dp_rank
        # P announces rank 0's port and cluster id; D finds rank r at position r from there.
        rank_zero = rank_address(config, dp_rank, 0, self._tp_size)
        # This start of the engine: in every lease word, in the params and (through the lease
        # words file) in every rank's handshake, so nothing of an earlier start passes.
        self._incarnation = secrets.randbits(64) or 1
        self._endpoint = RemoteEndpoint(
            engine_id=engine_id,
            host=config.side_channel_host,
            port=rank_zero.side_channel_port,
            tp_size=self._tp_size,
            cluster_id=rank_zero.cluster_id,
            incarnation=self._incarnation,
        )
        # A random start keeps a restarted P engine from reissuing ids D still holds.
        self._next_lease_id = secrets.randbits(32)

        # Per-step output, reset by build_connector_meta.
        self._to_recv: list[RecvSpec] = []
        self._to_release: list[ReleaseSpec] = []
        self._to_send: list[SendSpec] = []
        self._to_cancel: list[str] = []
        # D: requests whose RecvSpec went out and whose KV has not been reported yet.
        self._receiving: set[str] = set()
        # D: request_id -> heartbeat entry, from on_new_request until its KV arrived.
        self._waiting: dict[str, tuple[RemoteEndpoint, str, int]] = {}
        # Requests that show a misconfigured deployment (misconfig).
        self.misconfigured = Misconfigurations()
        # D: which reads go in the step that computes the first token.
        self._loads = InStepLoads(
            config.load_in_step_bytes,
            one_group_block_bytes(kv_cache_config),
            self._group_block_sizes[0],
            self._tp_size,
        )
        # P: request_id -> (lease id, slot), until the worker reports it in finished_sending.
        self._leased: dict[str, tuple[int, int]] = {}
        # P: every TP rank's lease words and their free slots.
        self._words = self._map_lease_words() if self._is_producer else []
        self._free_slots = list(range(min((w.slots for w in self._words), default=0) - 1, -1, -1))

    # ------------------------------------------------------------------ D side

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        request_id = request.request_id
        if params.get("do_remote_decode") and not self._is_producer:
            self.misconfigured.note("consumer_asked_to_produce", request_id)
        if self._is_consumer and not self._is_producer and not params:
            self.misconfigured.note("decode_without_params", request_id)
        if not params.get("do_remote_prefill"):
            return
        if not self._is_consumer:
            self.misconfigured.note("producer_asked_to_consume", request_id)
            return
        try:
            prefill = parse_remote_prefill(params)
        except InvalidTransferParams as exc:
            # The request fails when it is allocated (RecvSpec with an error), not here:
            # the scheduler cannot fail a request on its own.
            logger.error("request %s: %s", request_id, exc)
            if not any(key in params for key in OWN_PARAMS):
                self.misconfigured.note("foreign_params", request_id, ", ".join(OWN_PARAMS))
            return
        self._waiting[request_id] = (
            prefill.remote,
            prefill.remote_request_id,
            prefill.lease_id,
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self._is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        waiting = self._waiting.get(request.request_id)
        remote = waiting[0] if waiting is not None else None
        if self._loads.choose(
            request.request_id, remote, num_computed_tokens, request.num_prompt_tokens
        ):
            # Read before this step's forward, which computes the last prompt token itself
            # (for its logits) and so the first output token.
            return count - 1, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not self._is_consumer or not params or not params.get("do_remote_prefill"):
            return
        # One transfer per request: a second call (after the load) must not pull again.
        params["do_remote_prefill"] = False
        request_id = request.request_id
        local_hit = self._loads.allocated(request_id)
        in_step = local_hit is not None
        unfilled = blocks_to_fill(blocks.blocks, local_hit, self._group_block_sizes[0])
        local = tuple(block for _, group_blocks in unfilled for block in group_blocks)
        try:
            prefill = parse_remote_prefill(params)
        except InvalidTransferParams as exc:
            self._stop_heartbeat(request_id)
            if num_external_tokens > 0:
                self._refuse(request_id, None, local, str(exc), in_step)
            else:
                logger.error("request %s: nothing to pull, P not notified: %s", request_id, exc)
            return
        if num_external_tokens <= 0:
            self._release(request_id, prefill)
            return
        try:
            remote, ratio = remote_blocks_to_read(
                prefill, request.num_prompt_tokens, unfilled, self._group_block_sizes
            )
        except ValueError as exc:
            self._refuse(request_id, prefill, local, f"request {request_id}: {exc}", in_step)
            return
        if in_step:  # its KV is there once this step's forward starts: no lease to renew
            self._stop_heartbeat(request_id)
        else:
            self._receiving.add(request_id)
        self._to_recv.append(
            RecvSpec(
                request_id=request_id,
                remote_request_id=prefill.remote_request_id,
                lease_id=prefill.lease_id,
                remote=prefill.remote,
                local_block_ids=local,
                remote_block_ids=remote,
                blocks_per_block=ratio,
                lease_slot=prefill.lease_slot,
                lease_word=lease_word(
                    prefill.lease_id, prefill.block_ids, prefill.remote.incarnation
                ),
                in_step=in_step,
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, LinkReport):
            self._loads.report(report)
        for request_id in connector_output.finished_recving or ():
            self._stop_heartbeat(request_id)
            self._receiving.discard(request_id)
        for request_id in connector_output.finished_sending or ():
            # Every rank cleared its word before reporting: the slot can take a new lease.
            lease = self._leased.pop(request_id, None)
            if lease is not None:
                self._free_slots.append(lease[1])

    # ------------------------------------------------------------------ both sides

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid KV-cache manager: one KV-cache group."""
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        request_id = request.request_id
        self._stop_heartbeat(request_id)
        self._loads.forget(request_id)
        if request_id in self._receiving:
            # Aborted while its KV is on the way: the worker skips the read if it has not
            # started and tells P now. vLLM keeps the blocks until the worker reports it.
            self._to_cancel.append(request_id)
        if not params:
            return False, None
        if self._is_consumer and params.get("do_remote_prefill"):
            # Finished before its blocks were allocated (e.g. aborted): P still leases
            # the blocks, so tell it to free them now rather than at lease expiry.
            params["do_remote_prefill"] = False
            try:
                self._release(request_id, parse_remote_prefill(params))
            except InvalidTransferParams as exc:
                logger.error("request %s: cannot release its remote blocks: %s", request_id, exc)
            return False, None
        if not (self._is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status.name not in DELIVERABLE_STATUSES:
            return False, None
        if len(block_ids) != len(self._group_block_sizes):
            raise ValueError(
                f"request {request_id} has {len(block_ids)} KV-cache groups, this engine "
                f"{len(self._group_block_sizes)}"
            )
        return self._lease(request, block_ids)

    def _lease(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: keeps the prompt's blocks of every group under a fresh lease."""
        request_id = request.request_id
        # D needs the prompt's KV only; blocks past it hold P's generated tokens (when the
        # router asked P for more than one) and must not be offered. A sliding-window group
        # holds the null block where its blocks left the window: offered as such, never
        # leased, and D never reads it.
        prompt_blocks = tuple(
            tuple(group[: blocks_for_tokens(request.num_prompt_tokens, block_size)])
            for group, block_size in zip(block_ids, self._group_block_sizes, strict=True)
        )
        leased = tuple(b for group in prompt_blocks for b in group if b != NULL_BLOCK_ID)
        if not leased:
            return False, None
        if not self._free_slots:  # cannot happen: every lease holds a block of its own
            logger.error("request %s: no free lease slot; D will compute it", request_id)
            return False, None
        slot = self._free_slots.pop()
        lease_id = self._new_lease_id()
        word = lease_word(lease_id, prompt_blocks, self._incarnation)
        # Published before kv_transfer_params leave the engine: D can check it at once.
        for rank_words in self._words:
            rank_words.publish(slot, word)
        self._leased[request_id] = (lease_id, slot)
        self._to_send.append(SendSpec(request_id, lease_id, slot, word))
        return True, build_remote_decode_params(
            self._endpoint,
            request_id,
            prompt_blocks,
            request.num_prompt_tokens,
            (lease_id, slot),
            self._group_block_sizes,
        )

    def _map_lease_words(self) -> list[LeaseWords]:
        """Every TP rank's lease words: the workers created them when they registered their
        KV caches, before vLLM built this scheduler."""
        words = [
            LeaseWords.open(words_path(self._engine_id, self._dp_rank, rank))
            for rank in range(self._tp_size)
        ]
        for rank_words in words:  # mapped by every process that uses them now
            rank_words.unlink()
            rank_words.incarnation = self._incarnation  # the workers' handshakes announce it
        return words

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HixlConnectorMetadata:
        meta = HixlConnectorMetadata(
            to_recv=self._to_recv,
            to_release=self._to_release,
            to_send=self._to_send,
            to_cancel=self._to_cancel,
            heartbeats=list(self._waiting.values()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._to_recv, self._to_release, self._to_send, self._to_cancel = [], [], [], []
        return meta

    def get_finished_count(self) -> int | None:
        # Every worker rank reports every request it took part in: the world size.
        return None

    @property
    def num_leased(self) -> int:
        """P: block sets handed out and not yet reported in finished_sending."""
        return len(self._leased)

    @property
    def num_waiting(self) -> int:
        """D: requests whose remote KV has not arrived yet (the heartbeat list)."""
        return len(self._waiting)

    # ------------------------------------------------------------------ helpers

    def _new_lease_id(self) -> int:
        lease_id = self._next_lease_id
        self._next_lease_id = (lease_id + 1) % LEASE_ID_MODULUS
        return lease_id

    def _stop_heartbeat(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def _release(self, request_id: str, prefill: RemotePrefill) -> None:
        self._stop_heartbeat(request_id)
        self._to_release.append(
            ReleaseSpec(request_id, prefill.remote_request_id, prefill.lease_id, prefill.remote)
        )

    def _refuse(
        self,
        request_id: str,
        prefill: RemotePrefill | None,
        local: tuple[int, ...],
        error: str,
        in_step: bool = False,
    ) -> None:
        """Hands the request to the worker to fail: vLLM applies kv_load_failure_policy."""
        logger.error("refusing the remote prefill of request %s: %s", request_id, error)
        self._stop_heartbeat(request_id)
        self._to_recv.append(
            RecvSpec(
                request_id=request_id,
                remote_request_id=prefill.remote_request_id if prefill else "",
                lease_id=prefill.lease_id if prefill else 0,
                remote=prefill.remote if prefill else UNKNOWN_ENDPOINT,
                local_block_ids=local,
                remote_block_ids=(),
                error=error,
                in_step=in_step,
            )
        )
