"""D side: reads the KV of each RecvSpec without holding up vLLM's forward pass, and without
needing this process's Python while the bytes move.

`start` (on the step thread) plans the read and hands it to the engine as one guarded batch
(`leases.guarded_read`: P's lease word, the blocks, the word again). A request whose P ranks
are not linked yet first handshakes and links on a small pool, then does the same. `collect`
(on the step thread too) ends the batches that finished: the read is good only if the
guarded read's verdict vouches for it, so no round trip to P's Python is on the way, and no
thread of this process must win the interpreter lock to report the read.
"done" then goes to P on the notice lanes.

A read in the step (``RecvSpec.synchronous``, see sync_loads) feeds the forward of this very
step: `settle_sync_loads` waits for it before the forward. The scheduler asks for one only from
P ranks every worker reported reading in place (link_reports): a one-sided copy out of this
host's memory, which ends whatever P does, so the step waits on memory and never on a peer.
It never waits for a handshake or a free row either (synchronous reads have rows of their own),
and a failure is reported as its blocks (``invalidate``) rather than as a failed receive.

The step thread never handshakes or links: it looks peers up without connecting, and a read
whose P ranks are not all linked goes to the pool.

When the TP sizes differ, `tp_mapping` says which P ranks this rank reads and which KV heads
land where: the KV caches are registered one unit per KV head of a block, so a head
slice is read straight into place. When P's blocks are smaller, `block_slices` says which
slices of which P block land where in each of this rank's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.endpoints import PeerRank
from hixl_connector.connector.kv.decode_rank import DecodeRank
from hixl_connector.connector.leases.client import LeaseClient
from hixl_connector.connector.leases.guarded_read import GuardedPull
from hixl_connector.connector.mapping.read_plans import UnreadableRequest
from hixl_connector.connector.metadata import RecvSpec, ReleaseSpec
from hixl_connector.connector.peers.registry import Peer
from hixl_connector.connector.worker.read_failures import (
    HandshakeFailed,
    LeaseError,
    PeerGone,
    PullCancelled,
    counter_for,
)
from hixl_connector.connector.worker.read_units import (
    check_block_ids,
    check_block_sizes,
    check_state_tp,
    kv_beside_states,
    peer_units,
    state_reads,
)

logger = logging.getLogger(__name__)

# A read that waited longer than this to begin on the pool (behind other links, or for a
# scratch row) says so: the wait counts against the prefill engine's lease.
SLOW_START_S = 5.0


@dataclass(frozen=True)
class _InFlight:
    """A read the engine is doing: what it is for and how to judge it when it ends."""

    spec: RecvSpec
    peers: dict[int, Peer]
    readers: list[Peer]
    pull: GuardedPull[Any]
    handle: Any  # the engine's handle: poll(), wait(timeout), finished_at
    nbytes: int
    queued_at: float
    started: float


class Receiver:
    def __init__(self, rank: DecodeRank, lease_client: LeaseClient) -> None:
        self._rank = rank
        self._lease_client = lease_client
        # Handshakes and links with P ranks not linked yet, off the step thread.
        self._pool = ThreadPoolExecutor(
            rank.config.transfer_threads, thread_name_prefix="hixl-link"
        )
        self._pooled: set[Future[None]] = set()  # work given to the pool, until it ends
        # Each read's word-blocks-word batch, its scratch row and verdict (leases.guarded_read).
        self._guarded = rank.kv.guarded_reads()
        self._rows = self._guarded.rows
        self._closing = threading.Event()
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
        if spec.synchronous:
            self._start_sync_load(spec, queued_at)
            return False
        try:
            peers = self._peers_now(spec, self._rank.peers.linked)
        except Exception:  # the pool's attempt reports it
            peers = None
        row = self._rows.take_now() if peers is not None else None
        if row is not None:
            self._begin(spec, queued_at, row, peers)
            return False
        pooled = self._pool.submit(self._begin_pooled, spec, queued_at)
        self._pooled.add(pooled)
        pooled.add_done_callback(self._pooled.discard)
        return True

    def _start_sync_load(self, spec: RecvSpec, queued_at: float) -> None:
        """This step's forward needs the KV: reads it now over same-host links, without
        waiting for a handshake or for an asynchronous read's row."""
        try:
            peers = self._peers_now(spec, self._rank.peers.in_place)
            if peers is None:
                self._rank.outcomes.record("sync_load_peer_gone")
                raise PeerGone(
                    f"prefill engine {spec.remote.engine_id} has a rank with no same-host link "
                    "on this rank (restarted or gone since it was linked)"
                )
        except Exception as e:
            self._end(spec)
            self._fail(spec, {}, e)
            return
        assert peers is not None  # the step thread never connects
        row = self._rows.take_for_step()
        if row is None:  # this step's earlier synchronous reads give theirs back
            self.settle_sync_loads()
            row = self._rows.take_for_step()
        assert row is not None
        self._begin(spec, queued_at, row, peers)

    def settle_sync_loads(self) -> None:
        """Waits for this step's synchronous reads (the forward needs their KV) and ends them,
        with any other read that finished meanwhile."""
        with self._lock:
            flights = [flight for flight in self._in_flight if flight.spec.synchronous]
        for flight in flights:
            try:  # a same-host copy: it waits on memory, never on P
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
            self._lease_client.notify("release", self._release(spec))

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
            self._rows.give_back(flight.pull.row)
            self._end(flight.spec)
            if error is not None:
                self._fail(flight.spec, flight.peers, error)
                continue
            self._read_through(flight)
            landed = flight.handle.finished_at
            self._received(
                flight.spec, flight.nbytes, landed - flight.started, landed - flight.queued_at
            )

    def shutdown(self, wait_s: float) -> bool:
        """Stops the pool: queued reads are dropped, threads waiting for a row give up at
        once, and a handshake under way is waited for up to ``wait_s``; True when all the
        pool's work ended."""
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return not wait(list(self._pooled), timeout=wait_s).not_done

    def _peers_now(
        self, spec: RecvSpec, lookup: Callable[[PeerRank], Peer | None]
    ) -> dict[int, Peer] | None:
        """Every P rank the read needs, by ``lookup`` (which never connects); None when one
        is missing."""
        if spec.error:
            return {}
        peers: dict[int, Peer] = {}
        for p_rank in self._rank.plans.rank_plan(spec.remote.tp_size).notify:
            peer = lookup(spec.remote.rank(p_rank))
            if peer is None:
                return None
            peers[p_rank] = peer
        return peers

    def _begin_pooled(self, spec: RecvSpec, queued_at: float) -> None:
        began = time.monotonic()
        row = self._rows.take(self._closing)  # waits while every row is in flight
        if row is None:
            self._end(spec)
            return
        waits = (began - queued_at, time.monotonic() - began)
        if max(waits) > SLOW_START_S:
            message = "hixl: request %s: read queued %.1f s for the pool, %.1f s for a row"
            logger.warning(message, spec.request_id, *waits)
        self._begin(spec, queued_at, row)

    def _begin(
        self, spec: RecvSpec, queued_at: float, row: int, linked: dict[int, Peer] | None = None
    ) -> None:
        """Hands the read to the engine: with ``linked`` (the step thread) from those peers,
        else (the pool) from peers it handshakes and links where needed."""
        peers: dict[int, Peer] = {}
        try:
            if spec.error:
                raise LeaseError(spec.error)
            self._check_cancelled(spec)
            plan = self._rank.plans.rank_plan(spec.remote.tp_size)
            check_state_tp(spec, self._rank.layout.state)
            for p_rank in plan.notify:
                peers[p_rank] = linked[p_rank] if linked is not None else self._link(spec, p_rank)
                check_block_sizes(peers[p_rank], spec, self._rank.block_sizes)
            readers = [peers[p] for p in plan.notify if plan.reads_from(p)]
            try:
                check_block_ids(readers, spec)
            except LeaseError:
                self._rank.outcomes.record("refused_pulls")
                raise
            layout = self._rank.layout
            reads = [
                peer_units(peers[read.p_rank], read, spec, layout, self._rank.plans)
                for read in plan.reads
            ]
            states = state_reads(readers, spec, self._rank.tp_rank, layout.state)
            words = [(peer.cluster_id, spec.lease_slot) for peer in readers]
            if layout.state is not None and layout.kv_in_states_buffers:
                units = [
                    kv_beside_states(peers[read.p_rank], units, spec, layout.state)
                    for read, units in zip(plan.reads, reads, strict=True)
                ]
                blocks = self._rank.kv.state_pulls(units)
            else:
                blocks = self._rank.kv.block_pulls(reads, spec.blocks_per_block > 1)
            blocks += self._rank.kv.state_pulls(states) if states else []
            pull = self._guarded.batch(words, blocks, row)
            handle, started = self._submit(spec, pull)
        except Exception as e:
            self._rows.give_back(row)
            self._end(spec)
            self._fail(spec, peers, e)
            return
        unit_bytes = layout.slice_bytes if spec.blocks_per_block > 1 else layout.unit_bytes
        nbytes = sum(len(src) for _, src, _ in reads) * unit_bytes * layout.num_tensors
        if layout.state is not None:
            nbytes += layout.state.moved_bytes(sum(len(src) for _, src, _ in states))
        flight = _InFlight(spec, peers, readers, pull, handle, nbytes, queued_at, started)
        with self._lock:
            self._in_flight.append(flight)

    def _link(self, spec: RecvSpec, p_rank: int) -> Peer:
        """P rank ``p_rank`` of the request's engine, handshaken and linked (on the pool)."""
        try:
            return self._rank.peers.get(spec.remote.rank(p_rank))
        except Exception as e:
            raise HandshakeFailed(str(e)) from e

    def _submit(self, spec: RecvSpec, pull: GuardedPull[Any]) -> tuple[Any, float]:
        """Hands the words and blocks to the engine as one batch, unless the request was
        aborted since it was queued; returns the handle and when the batch was handed over."""
        self._check_cancelled(spec)
        started = time.monotonic()
        return self._rank.kv.submit(pull.pulls), started

    def _read_through(self, flight: _InFlight) -> None:
        """Tells the registry the read went through (it tells the scheduler whether reads
        from this P engine are in place, link_reports); counts the small ones that load
        asynchronously because they cross the network."""
        in_place = all(peer.in_place for peer in flight.peers.values())
        self._rank.peers.read_through(flight.spec.remote, flight.peers.values())
        small = flight.nbytes <= self._rank.config.sync_load_bytes
        if not in_place and not flight.spec.synchronous and small:
            self._rank.outcomes.record("network_reads_async")

    def _vouch(self, flight: _InFlight) -> None:
        """Raises LeaseError unless P's words vouched for the blocks before and after (the
        verdict of leases.guarded_read: anything else read alongside is discarded)."""
        spec = flight.spec
        outcome, reader = self._guarded.verdict(flight.pull, spec.lease_word)
        if outcome == "refused":
            peer = flight.readers[reader]
            self._rank.outcomes.record("refused_pulls")
            raise LeaseError(
                f"prefill engine {peer.engine_id} rank {peer.payload.tp_rank} does not lease "
                f"these blocks to request {spec.remote_request_id} under lease "
                f"{spec.lease_id}: unknown or ended lease, or blocks outside it"
            )
        if outcome == "stale":
            self._rank.outcomes.record("stale_pulls")
            raise LeaseError(
                f"lease {spec.lease_id} of prefill request {spec.remote_request_id} "
                "ended during the pull; its blocks may have been reused"
            )

    def _check_cancelled(self, spec: RecvSpec) -> None:
        with self._lock:
            if spec.request_id in self._cancelled:
                raise PullCancelled(
                    f"request {spec.request_id} was aborted before its read ended; nothing read is "
                    "used"
                )

    def _end(self, spec: RecvSpec) -> None:
        with self._lock:
            self._active.pop(spec.request_id, None)
            self._cancelled.discard(spec.request_id)

    def _received(self, spec: RecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        """The blocks of ``spec`` are in place, vouched for by P: reports them."""
        self._rank.outcomes.record_pull(pull_s, ready_s, nbytes, len(spec.every_local_block))
        if spec.synchronous:
            self._rank.outcomes.record("sync_loads")
        else:
            self._rank.outcomes.finish(spec.request_id, True, spec.every_local_block)
        self._lease_client.notify("done", self._release(spec))

    def _fail(self, spec: RecvSpec, peers: dict[int, Peer], error: Exception) -> None:
        counter = counter_for(spec, error)
        if counter is not None:
            self._rank.outcomes.record(counter)
        if isinstance(error, PullCancelled):  # P was told when it was cancelled
            logger.info("hixl: %s", error)
            self._failed(spec)
            return
        logger.error("hixl: KV pull for request %s failed: %s", spec.request_id, error)
        if peers and self._link_suspect(error):
            for peer in peers.values():
                self._rank.peers.drop(peer)
        self._failed(spec)
        if spec.remote.engine_id:
            # Tell P now (on the notice lanes, not this pull thread) so it frees instead of
            # waiting for the lease to expire.
            self._lease_client.notify("release", self._release(spec))

    def _failed(self, spec: RecvSpec) -> None:
        """Tells vLLM: a failed receive, or for a synchronous read its blocks (vLLM's
        kv_load_failure_policy decides either way)."""
        if spec.synchronous:
            self._rank.outcomes.invalidate(spec.every_local_block)
        else:
            self._rank.outcomes.finish(spec.request_id, False, spec.every_local_block)

    @staticmethod
    def _release(spec: RecvSpec) -> ReleaseSpec:
        return ReleaseSpec(spec.request_id, spec.remote_request_id, spec.lease_id, spec.remote)

    def _link_suspect(self, error: Exception) -> bool:
        """Timeouts, dead peers and lost replies call for a fresh handshake and link of the
        peers the read used (a failed handshake leaves the links it did not touch alone)."""
        if isinstance(error, (LeaseError, UnreadableRequest, HandshakeFailed)):
            return False
        status = getattr(error, "status_code", None)
        return status != self._rank.kv.api.LLMStatusCode.LLM_PARAM_INVALID
