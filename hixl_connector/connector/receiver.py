"""D side: reads the KV of each RecvSpec without holding up vLLM's forward pass, and without
needing this process's Python while the bytes move.

`start` (on the step thread) plans the read and hands it to the engine as one batch: P's lease
word for the request, the blocks, and the lease word again (`lease_words`). A request whose P
ranks are not linked yet first handshakes and links on a small pool, then does the same.
`collect` (on the step thread too) ends the batches that finished: the read is good only if
the word vouched for exactly these blocks before and after, so no round trip to P's Python is
on the way, and no thread of this process must win the interpreter lock to report the read.
"done" then goes to P on the notice lanes.

A read in the step (``RecvSpec.in_step``, see in_step_loads) feeds the forward of this very
step: `settle_in_step` waits for it before the forward, it never waits for a handshake (one
whose P rank is not linked fails at once), and a failure is reported as its blocks
(``invalidate``) rather than as a failed receive.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.block_slices import blocks_per_block, slice_ids
from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.engine_setup import IN_FLIGHT_READS, Engine, GuardedPull
from hixl_connector.connector.kv_layout import KVLayout
from hixl_connector.connector.lease_client import LeaseClient
from hixl_connector.connector.metadata import RecvSpec, ReleaseSpec
from hixl_connector.connector.peers import Peer, PeerRegistry
from hixl_connector.connector.read_plans import ReadPlans, UnreadableRequest
from hixl_connector.connector.tp_mapping import HeadRead, TPMismatch, unit_ids

logger = logging.getLogger(__name__)

# (peer cluster id, source ids, destination ids): one P rank's share of a request.
Read = tuple[int, list[int], list[int]]


class LeaseError(RuntimeError):
    """P did not (or could no longer) vouch for the blocks of a pull."""


class PullCancelled(RuntimeError):
    """The request was aborted before its read ended."""


class NotReadableInStep(RuntimeError):
    """An in-step read cannot begin on the step thread at once."""


@dataclass(frozen=True)
class _InFlight:
    """A read the engine is doing: what it is for and how to judge it when it ends."""

    spec: RecvSpec
    peers: dict[int, Peer]
    readers: list[Peer]
    pull: GuardedPull
    handle: Any  # the engine's handle: poll(), wait(timeout), finished_at
    nbytes: int
    queued_at: float
    started: float


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
        invalidate: Callable[[tuple[int, ...]], None],
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
        self._finish = finish  # an asynchronous read ended (ok or not)
        self._invalidate = invalidate  # an in-step read failed: its blocks hold no KV
        # Handshakes and links with P ranks not linked yet, off the step thread.
        self._pool = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="hixl-link")
        # One row of scratch words per read in flight: where its batch reads P's lease words.
        self._rows: queue.SimpleQueue[int] = queue.SimpleQueue()
        for row in range(IN_FLIGHT_READS):
            self._rows.put(row)
        self._in_flight: list[_InFlight] = []
        # Requests not yet collected, and those of them aborted since.
        self._active: dict[str, RecvSpec] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def start(self, spec: RecvSpec, queued_at: float) -> bool:
        """Begins the read of ``spec`` (on the step thread) where every P rank it reads is
        linked, else on the pool; True when it went to the pool."""
        with self._lock:
            self._active[spec.request_id] = spec
        ready = self._ready(spec)
        row = self._free_row() if ready else None
        if row is not None:
            self._begin(spec, queued_at, row)
            return False
        if spec.in_step:  # the forward cannot wait for a handshake, nor for a free row
            self._end(spec)
            why = "a prefill rank it reads is not linked" if not ready else "no free read row"
            self._fail(spec, {}, NotReadableInStep(f"cannot read in the step: {why}"))
            return False
        self._pool.submit(self._begin_pooled, spec, queued_at)
        return True

    def settle_in_step(self) -> None:
        """Waits for this step's in-step reads (the forward needs their KV) and ends them,
        with any other read that finished meanwhile."""
        with self._lock:
            flights = [flight for flight in self._in_flight if flight.spec.in_step]
        for flight in flights:
            try:  # each pull is bounded by pull_timeout_s; a batch has several
                flight.handle.wait(None)
            except Exception:  # its failure is reported by collect
                pass
        if flights:
            self.collect()

    def cancel(self, request_id: str) -> None:
        """The request was aborted: P is told now, a read not yet begun never begins, and one
        under way is discarded (either way it is reported failed, so vLLM frees the blocks)."""
        with self._lock:
            spec = self._active.get(request_id)
            if spec is None or request_id in self._cancelled:
                return  # already collected (and P told)
            self._cancelled.add(request_id)
        if spec.remote.engine_id:
            self._notices.release_later(self._release(spec))

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def collect(self, wait_s: float = 0.0) -> None:
        """Ends every read whose batch finished (on the step thread); with ``wait_s``, first
        waits up to that long for the oldest one."""
        with self._lock:
            flights = list(self._in_flight)
        if wait_s and flights:
            try:
                flights[0].handle.wait(wait_s)
            except Exception:  # its failure is reported below
                pass
        for flight in flights:
            error: Exception | None = None
            try:
                if not flight.handle.poll():
                    continue
                self._check_cancelled(flight.spec)
                self._vouch(flight)
            except Exception as e:
                error = e
            with self._lock:
                self._in_flight.remove(flight)
            self._rows.put(flight.pull.row)
            self._end(flight.spec)
            if error is not None:
                self._fail(flight.spec, flight.peers, error)
                continue
            landed = flight.handle.finished_at
            self._received(
                flight.spec, flight.nbytes, landed - flight.started, landed - flight.queued_at
            )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _free_row(self) -> int | None:
        try:
            return self._rows.get_nowait()
        except queue.Empty:
            return None

    def _ready(self, spec: RecvSpec) -> bool:
        """Whether the read can begin on the step thread: every P rank it reads is linked."""
        if spec.error:
            return True
        try:
            plan = self._plans.rank_plan(spec.remote.tp_size)
            return all(self._peers.is_linked(spec.remote.rank(p)) for p in plan.notify)
        except Exception:  # the pool's attempt reports it
            return False

    def _begin_pooled(self, spec: RecvSpec, queued_at: float) -> None:
        self._begin(spec, queued_at, self._rows.get())  # waits while every row is in flight

    def _begin(self, spec: RecvSpec, queued_at: float, row: int) -> None:
        peers: dict[int, Peer] = {}
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
            handle, started = self._submit(spec, pull)
        except Exception as e:
            self._rows.put(row)
            self._end(spec)
            self._fail(spec, peers, e)
            return
        layout = self._layout
        unit_bytes = layout.slice_bytes if spec.blocks_per_block > 1 else layout.unit_bytes
        nbytes = sum(len(src) for _, src, _ in reads) * unit_bytes * layout.num_tensors
        flight = _InFlight(spec, peers, readers, pull, handle, nbytes, queued_at, started)
        with self._lock:
            self._in_flight.append(flight)

    def _submit(self, spec: RecvSpec, pull: GuardedPull) -> tuple[Any, float]:
        """Hands the words and blocks to the engine as one batch, unless the request was
        aborted since it was queued; returns the handle and when the batch was handed over."""
        self._check_cancelled(spec)
        started = time.monotonic()
        return self._engine.submit(pull.pulls), started

    def _vouch(self, flight: _InFlight) -> None:
        """Raises LeaseError unless P's words vouched for the blocks before and after."""
        spec = flight.spec
        before, after = self._engine.words_read(flight.pull)
        # P publishes a word before the blocks leave its engine and clears it before it
        # reuses them, never publishing it again: found before and after, the blocks were
        # this request's throughout. Anything else read alongside is discarded.
        vouched = zip(flight.readers, before, strict=True)
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

    def _check_cancelled(self, spec: RecvSpec) -> None:
        with self._lock:
            if spec.request_id in self._cancelled:
                raise PullCancelled(f"request {spec.request_id} was aborted before its read")

    def _end(self, spec: RecvSpec) -> None:
        with self._lock:
            self._active.pop(spec.request_id, None)
            self._cancelled.discard(spec.request_id)

    def _received(self, spec: RecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        """The blocks of ``spec`` are in place, vouched for by P: reports them."""
        self._record_pull(pull_s, ready_s, nbytes, len(spec.local_block_ids))
        if spec.in_step:
            self._record("in_step_loads")
        else:
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
            self._failed(spec)
            return
        logger.error("hixl: KV pull for request %s failed: %s", spec.request_id, error)
        if spec.error or isinstance(error, (TPMismatch, UnreadableRequest)):
            self._record("invalid_requests")  # refused before anything was read
        else:
            linking = not peers and not isinstance(error, NotReadableInStep)
            self._record("failed_handshakes" if linking else "failed_pulls")
        if peers and self._link_suspect(error):
            for peer in peers.values():
                self._peers.mark_broken(peer)
        self._failed(spec)
        if spec.remote.engine_id:
            # Tell P now (on the notice lanes, not this pull thread) so it frees instead of
            # waiting for the lease to expire.
            self._notices.release_later(self._release(spec))

    def _failed(self, spec: RecvSpec) -> None:
        """Tells vLLM: a failed receive, or for an in-step read its blocks (vLLM's
        kv_load_failure_policy decides either way)."""
        if spec.in_step:
            self._invalidate(spec.local_block_ids)
        else:
            self._finish(spec.request_id, False)

    @staticmethod
    def _release(spec: RecvSpec) -> ReleaseSpec:
        return ReleaseSpec(spec.request_id, spec.remote_request_id, spec.lease_id, spec.remote)

    def _link_suspect(self, error: Exception) -> bool:
        """Timeouts, dead peers and lost replies call for a fresh handshake and link."""
        if isinstance(error, (LeaseError, UnreadableRequest)):
            return False
        status = getattr(error, "status_code", None)
        return status != self._engine.api.LLMStatusCode.LLM_PARAM_INVALID
