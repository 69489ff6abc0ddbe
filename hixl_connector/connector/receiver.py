"""D side: one job per RecvSpec on the worker's transfer pool, so vLLM's forward pass never
waits on a transfer.

A job handshakes and links on first use of each P rank it reads, then reads, in one engine
call, P's lease word for the request, the blocks, and the lease word again (`lease_words`):
the read is good only if the word vouched for exactly these blocks before and after, so no
round trip to P's Python, nor back into this process's Python, is on the way. "done" then goes
to P on the notice lanes, off the pull thread.

When the TP sizes differ, `tp_mapping` says which P ranks this rank reads and which KV heads
land where: the KV caches are registered one unit per KV head of a block, so a head
slice is read straight into place. When P's blocks are smaller, `block_slices` says which
slices of which P block land where in each of this rank's blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from hixl_connector.connector.block_slices import SliceRun, blocks_per_block, slice_ids
from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.engine_setup import Engine, GuardedPull
from hixl_connector.connector.kv_layout import KVLayout
from hixl_connector.connector.lease_client import LeaseClient
from hixl_connector.connector.metadata import RecvSpec, ReleaseSpec, RemoteEndpoint
from hixl_connector.connector.peers import Peer, PeerRegistry
from hixl_connector.connector.tp_mapping import (
    HeadRead,
    RankPlan,
    TPMismatch,
    check_shardable,
    plan_rank,
    unit_ids,
)

logger = logging.getLogger(__name__)

# (peer cluster id, source ids, destination ids): one P rank's share of a request.
Read = tuple[int, list[int], list[int]]


class LeaseError(RuntimeError):
    """P did not (or could no longer) vouch for the blocks of a pull."""


class PullCancelled(RuntimeError):
    """The request was aborted before its read began."""


class UnreadableRequest(ValueError):
    """The request's blocks cannot be read from this peer (block sizes, layout): nothing is
    read, the link stays good."""


class ReadPlans:
    """What this rank reads of a P engine, worked out once per P shape: which P ranks and
    heads (by P's TP size), and where P's slices land (by P's block size)."""

    def __init__(
        self,
        compatibility: dict[str, Any],
        tp: tuple[int, int],
        probe: Callable[[int], tuple[SliceRun, ...]],
    ) -> None:
        self._split = compatibility["kv_split"]
        self._kv_layout = compatibility["kv_layout"]
        self._num_kv_heads = compatibility["num_kv_heads"]
        self._tp_rank, self._tp_size = tp
        self._probe = probe
        self._plans: dict[int, RankPlan] = {}  # P's tp_size -> this rank's reads
        self._runs: dict[int, tuple[SliceRun, ...]] = {}  # P's block size -> slice runs

    def rank_plan(self, p_tp: int) -> RankPlan:
        """Which P ranks this rank reads (and which heads), for a P engine of TP ``p_tp``;
        raises TPMismatch when the sizes cannot be mapped."""
        plan = self._plans.get(p_tp)
        if plan is None:
            heads, split = self._num_kv_heads, self._split
            check_shardable(split, self._kv_layout, heads, p_tp, self._tp_size)
            if split == "none":  # whole blocks, from the rank of the same index
                r = self._tp_rank
                plan = RankPlan((HeadRead(r, 0, 0, 1),), (r,), {r: 1})
            else:
                replicated = split == "replicated"
                plan = plan_rank(heads, p_tp, self._tp_size, self._tp_rank, replicated)
            self._plans[p_tp] = plan
        return plan

    def notify_targets(self, remote: RemoteEndpoint) -> dict[int, int]:
        """P rank -> distinct D ranks it waits for, for every P rank this rank notifies.

        When the TP sizes cannot be mapped, every D rank tells every P rank, so P still frees.
        """
        try:
            return self.rank_plan(remote.tp_size).consumers
        except TPMismatch:
            return dict.fromkeys(range(remote.tp_size), self._tp_size)

    def slice_runs(self, p_block_size: int) -> tuple[SliceRun, ...]:
        runs = self._runs.get(p_block_size)
        if runs is None:
            try:
                runs = self._probe(p_block_size)
            except ValueError as e:
                raise UnreadableRequest(str(e)) from None
            self._runs[p_block_size] = runs
        return runs


class Receiver:
    def __init__(
        self,
        config: HixlConfig,
        engine: Engine,
        layout: KVLayout,
        block_sizes: tuple[int, ...],
        plans: ReadPlans,
        peers: PeerRegistry,
        notices: LeaseClient,
        tp_rank: int,
        record: Callable[[str], None],
        record_pull: Callable[[float, float, int, int], None],
        finish: Callable[[str, bool], None],
    ) -> None:
        self._config = config
        self._engine = engine
        self._layout = layout
        self._block_sizes = block_sizes
        self._plans = plans
        self._peers = peers
        self._notices = notices
        self._tp_rank = tp_rank
        self._record = record
        self._record_pull = record_pull
        self._finish = finish
        # One row of scratch words per transfer thread: where a job reads P's lease words to.
        self._scratch: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(config.transfer_threads):
            self._scratch.put(index)
        # Requests queued or being read, and those of them aborted since.
        self._active: dict[str, RecvSpec] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def queued(self, spec: RecvSpec) -> None:
        """Called as the job is queued, before ``receive`` runs it."""
        with self._lock:
            self._active[spec.request_id] = spec

    def cancel(self, request_id: str) -> None:
        """The request was aborted: P is told now, and a read not yet begun never begins (it
        is still reported, as failed, so vLLM frees the blocks)."""
        with self._lock:
            spec = self._active.get(request_id)
            if spec is None or request_id in self._cancelled:
                return  # its job already ended (and told P)
            self._cancelled.add(request_id)
        if spec.remote.engine_id:
            self._notices.release_later(self._release(spec))

    def _check_cancelled(self, spec: RecvSpec) -> None:
        with self._lock:
            if spec.request_id in self._cancelled:
                raise PullCancelled(f"request {spec.request_id} was aborted before its read")

    def receive(self, spec: RecvSpec, queued_at: float) -> None:
        peers: dict[int, Peer] = {}
        row = self._scratch.get()
        try:
            if spec.error:
                raise LeaseError(spec.error)
            self._check_cancelled(spec)
            plan = self._plans.rank_plan(spec.remote.tp_size)
            for p_rank in plan.notify:
                peers[p_rank] = self._peers.get(spec.remote.rank(p_rank))
                self._check_block_sizes(peers[p_rank], spec)
            readers = [peers[p] for p in plan.notify if plan.reads_from(p)]
            self._check_block_ids(readers, spec)
            reads = [self._heads(peers[read.p_rank], read, spec) for read in plan.reads]
            words = [(peer.cluster_id, spec.lease_slot) for peer in readers]
            pull = self._engine.lease_guarded_pull(words, reads, spec.blocks_per_block > 1, row)
            started = time.monotonic()
            self._pull(spec, pull)
            finished = time.monotonic()
            before, after = self._engine.words_read(pull)
            # P publishes a word before the blocks leave its engine and clears it before it
            # reuses them, never publishing it again: found before and after, the blocks were
            # this request's throughout. Anything else read alongside is discarded.
            vouched = zip(readers, before, strict=True)
            refusing = [peer for peer, word in vouched if word != spec.lease_word]
            if refusing:
                self._record("refused_pulls")
                raise LeaseError(
                    f"prefill engine {refusing[0].engine_id} rank {refusing[0].payload.tp_rank} "
                    f"does not lease these blocks to request {spec.remote_request_id} under "
                    f"lease {spec.lease_id}: unknown or ended lease, or blocks outside it"
                )
            if any(word != spec.lease_word for word in after):
                self._record("stale_pulls")
                raise LeaseError(
                    f"lease {spec.lease_id} of prefill request {spec.remote_request_id} "
                    "ended during the pull; its blocks may have been reused"
                )
        except Exception as e:
            self._fail(spec, peers, e)
            return
        finally:
            self._scratch.put(row)
            with self._lock:
                self._active.pop(spec.request_id, None)
                self._cancelled.discard(spec.request_id)
        layout = self._layout
        unit_bytes = layout.slice_bytes if spec.blocks_per_block > 1 else layout.unit_bytes
        moved = sum(len(src) for _, src, _ in reads) * unit_bytes * layout.num_tensors
        self._received(spec, moved, finished - started, finished - queued_at)

    def _pull(self, spec: RecvSpec, pull: GuardedPull) -> None:
        """Reads the words and blocks in one engine call, unless the request was aborted
        since it was queued."""
        self._check_cancelled(spec)
        self._engine.run(pull.pulls)

    def _received(self, spec: RecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        """The blocks of ``spec`` are in place, vouched for by P: reports them."""
        self._record_pull(pull_s, ready_s, nbytes, len(spec.local_block_ids))
        self._finish(spec.request_id, True)
        self._notices.release_later(self._release(spec), "done")

    def _heads(self, peer: Peer, read: HeadRead, spec: RecvSpec) -> Read:
        """One P rank's heads of the request's blocks, to land straight in their slots here:
        ids of units, or of slices where P's blocks are smaller."""
        layout = self._layout
        ratio = spec.blocks_per_block
        if ratio == 1:
            src = unit_ids(
                spec.remote_block_ids, peer.payload.units_per_block, read.src_head, read.count
            )
            dst = unit_ids(spec.local_block_ids, layout.units_per_block, read.dst_head, read.count)
            return peer.cluster_id, src, dst
        src, dst = slice_ids(
            spec.remote_block_ids,
            spec.local_block_ids,
            self._plans.slice_runs(peer.payload.block_sizes[0]),
            ratio,
            (peer.payload.units_per_block, read.src_head, layout.slices_per_unit // ratio),
            (layout.units_per_block, read.dst_head, layout.slices_per_unit),
            read.count,
        )
        return peer.cluster_id, src, dst

    def _check_block_ids(self, readers: list[Peer], spec: RecvSpec) -> None:
        """Block ids beyond a P rank's cache are refused before anything is read (the words
        would refuse them too, but only after the read failed on them)."""
        highest = max(spec.remote_block_ids, default=-1)
        for peer in readers:
            if highest >= peer.payload.num_blocks:
                self._record("refused_pulls")
                raise LeaseError(
                    f"block id {highest} is beyond the {peer.payload.num_blocks} blocks of "
                    f"prefill engine {peer.engine_id} rank {peer.payload.tp_rank}"
                )

    def _check_block_sizes(self, peer: Peer, spec: RecvSpec) -> None:
        """The block ids of the request were mapped for the block size P registered."""
        ratio = blocks_per_block(peer.payload.block_sizes, self._block_sizes)
        if ratio != spec.blocks_per_block:
            raise UnreadableRequest(
                f"kv_transfer_params of request {spec.remote_request_id} map "
                f"{spec.blocks_per_block} prefill blocks to a decode block, but prefill engine "
                f"{peer.engine_id} has block_size {peer.payload.block_sizes} and this engine "
                f"{list(self._block_sizes)}"
            )

    def _fail(self, spec: RecvSpec, peers: dict[int, Peer], error: Exception) -> None:
        if isinstance(error, PullCancelled):  # P was told when it was cancelled
            logger.info("hixl: %s", error)
            self._record("cancelled_pulls")
            self._finish(spec.request_id, False)
            return
        logger.error("hixl: KV pull for request %s failed: %s", spec.request_id, error)
        if spec.error or isinstance(error, (TPMismatch, UnreadableRequest)):
            self._record("invalid_requests")  # refused before anything was read
        else:
            self._record("failed_pulls" if peers else "failed_handshakes")
        if peers and self._link_suspect(error):
            for peer in peers.values():
                self._peers.mark_broken(peer)
        self._finish(spec.request_id, False)
        if spec.remote.engine_id:
            # Tell P now (on the notice lanes, not this pull thread) so it frees instead of
            # waiting for the lease to expire.
            self._notices.release_later(self._release(spec))

    @staticmethod
    def _release(spec: RecvSpec) -> ReleaseSpec:
        return ReleaseSpec(spec.request_id, spec.remote_request_id, spec.lease_id, spec.remote)

    def _link_suspect(self, error: Exception) -> bool:
        """Timeouts, dead peers and lost replies call for a fresh handshake and link."""
        if isinstance(error, (LeaseError, UnreadableRequest)):
            return False
        status = getattr(error, "status_code", None)
        return status != self._engine.api.LLMStatusCode.LLM_PARAM_INVALID
