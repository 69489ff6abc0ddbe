"""D side of push mode, one worker rank: hands the request's blocks to the P ranks that hold
its KV heads and waits for them to write.

For each ``PushRecvSpec``, on a small pool (never the step thread): learn P's cluster id and
incarnation from a first-contact handshake when the router named P only by address
(``push.contact``, kept per address until a push with it fails); then, for each P rank this
rank mirrors a KV head of (as a pull would read them: tp_mapping), link it (PeerRegistry),
grant its cluster those heads of the request's blocks in every registered KV cache (where
P's blocks are smaller: their slices, with where each slice of P's blocks lands), the units
of a hybrid state model's state slots that P rank holds (its whole state between equal TP
sizes, else this rank's slices of it: state_layout.shard_runs), and one push word
of its own, clear the word, and register all of it with that rank (``push_register``).
Each P rank writes its heads, then its lease word into its push word. `collect` (on the step
thread) looks at the words: once every one is set, every block landed, and the request is
reported received; an idle step sleeps until a write lands in D's engine
(``wait_for_writes``) rather than polling the words. A P rank nobody reads (a replica) hears
from one D rank that it has nothing to write.

Why D never decodes a block written for another request, nor lets one be written after it
reported the request: ``guarded_write`` (grants, layers, word, revoke). D gives up on its own
after ``push_timeout_s`` (the router never aborts D), and sooner where it learns that no word
will come: every ``PUSH_CHECK_S`` while a request has waited that long, it asks the P rank
(``push.status``). P names the pushes it gave up on (D fails them, and links again first
where P lost the link it writes over); a P rank that does not answer within
``handshake_timeout_s``, refuses (it restarted), or whose host refuses the side channel's
connection (its process died), is gone: every request waiting on it fails at once, its link
is dropped, and so is every request that reached this rank before and still waits to
register with it (push.contact). A request that timed out drops its link to the P ranks, as
after a read that timed out, so the next request links again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.kv.decode_rank import DecodeRank
from hixl_connector.connector.kv.state_layout import state_without_kv
from hixl_connector.connector.mapping.block_slices import blocks_per_block
from hixl_connector.connector.mapping.state_shards import ShardMismatch
from hixl_connector.connector.mapping.tp_mapping import RankPlan
from hixl_connector.connector.metadata import PushRecvSpec
from hixl_connector.connector.peers.registry import Peer
from hixl_connector.connector.peers.side_channel import SideChannelTimeout
from hixl_connector.connector.push.contact import PeerLost, PrefillEndpoints, PushRefused
from hixl_connector.connector.push.guarded_write import (
    PushWords,
    Writer,
    grant_writer,
    revoke_writer,
)
from hixl_connector.connector.push.registration import (
    HeadRun,
    PushRegistration,
    Slices,
    StateRun,
)
from hixl_connector.connector.push.status import PUSH_CHECK_S, PushStatusQuery, gave_up_in

logger = logging.getLogger(__name__)


@dataclass
class _Awaited:
    spec: PushRecvSpec
    writers: list[Writer] = field(default_factory=list)
    registered_at: float = 0.0
    fresh: bool = False  # P's start was learned for this request (first contact)
    slices: Slices | None = None  # P's blocks are smaller: it writes slices of D's
    state_units: int = 0  # of this rank's state registration, the P ranks write

    def slots(self) -> list[int]:
        return [w.slot for w in self.writers if w.slot is not None]


class PushReceiver:
    def __init__(self, rank: DecodeRank) -> None:
        """``rank.plans``: which P ranks write which of this rank's KV heads (by P's TP size),
        and where the slices of P's blocks land (by P's block size), as a pull would read
        them."""
        kv = rank.kv
        if kv.push_words is None or kv.push_word_memory is None:
            raise ValueError("push mode needs this decode engine's push words registered")
        self._rank = rank
        self._words = PushWords(kv.push_word_memory)
        self._pool = ThreadPoolExecutor(
            rank.config.transfer_threads, thread_name_prefix="hixl-push"
        )
        self._lock = threading.Lock()
        self._awaited: dict[str, _Awaited] = {}  # registered with P, word not set yet
        # Requests with blocks to receive, from start until reported; those aborted meanwhile.
        self._started: set[str] = set()
        self._cancelled: set[str] = set()
        self._endpoints = PrefillEndpoints(rank.peers)
        # P ranks asked about the pushes awaited from them (peer key): when next, and
        # whether a question is under way.
        self._next_check: dict[tuple[str, int, str, int], float] = {}
        self._checking: set[tuple[str, int, str, int]] = set()

    def start(self, spec: PushRecvSpec, queued_at: float) -> None:
        """Registers the request's blocks with P (on the pool)."""
        if spec.every_local_block:
            with self._lock:
                self._started.add(spec.request_id)
        self._pool.submit(self._register, spec, queued_at)

    def cancel(self, request_id: str) -> None:
        """Aborted: its grants are revoked and it is reported failed (vLLM frees after)."""
        with self._lock:
            if request_id not in self._started:
                return  # not a push of this rank's (a pull), or reported already
            self._cancelled.add(request_id)
            awaited = self._awaited.pop(request_id, None)
        if awaited is not None:
            self._pool.submit(self._give_up, awaited, "aborted")

    def wait_for_word(self, timeout_s: float, woken: threading.Event) -> bool:
        """An idle step's wait: until a word of a request awaited now is set, or
        ``timeout_s`` passed, asleep until a peer's write lands (``woken`` is looked at on
        each wake); False, without waiting, when no request is awaited.
        (A request registered meanwhile is looked at in the next step, ``timeout_s`` on.)"""
        with self._lock:
            slots = [slot for awaited in self._awaited.values() for slot in awaited.slots()]
        if not slots:
            return False
        # The count is read before the words: a word landing in between moves it, so the
        # wait below returns at once instead of sleeping past it.
        deadline = time.monotonic() + timeout_s
        landed = self._rank.kv.writes_landed()
        while not woken.is_set() and not any(self._words.is_set(slot) for slot in slots):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            landed = self._rank.kv.wait_for_writes(landed, left)
        return True

    def collect(self) -> None:
        """Ends the requests whose word P set (on the step thread), and those past their time."""
        now = time.monotonic()
        landed: list[_Awaited] = []
        late: list[_Awaited] = []
        with self._lock:
            for awaited in self._awaited.values():
                slots = awaited.slots()
                if slots and all(self._words.is_set(slot) for slot in slots):
                    landed.append(awaited)
                elif now - awaited.registered_at > self._rank.config.push_timeout_s:
                    late.append(awaited)
            for awaited in landed + late:
                del self._awaited[awaited.spec.request_id]
        for awaited in landed:
            self._landed(awaited, now)
        for awaited in late:
            self._rank.outcomes.record("push_timeouts")
            reason = (
                f"no push from P within push_timeout_s ({self._rank.config.push_timeout_s:g} s)"
            )
            self._pool.submit(self._give_up, awaited, reason)
        for awaited in late:
            # As after a read that timed out: the link may be lost on P's side (its write
            # timed out), so the next request links again rather than trusting it.
            for writer in awaited.writers:
                self._drop(writer.peer, f"the link was dropped: {reason}")
        self._ask_about_waits(now)

    def _ask_about_waits(self, now: float) -> None:
        """Asks each P rank about the pushes awaited from it for PUSH_CHECK_S or more, at
        most once every PUSH_CHECK_S and one question at a time (on the pool)."""
        asks: dict[tuple[str, int, str, int], tuple[Peer, RemoteEndpoint, list[str]]] = {}
        with self._lock:
            for awaited in self._awaited.values():
                if now - awaited.registered_at < PUSH_CHECK_S:
                    continue
                for writer in awaited.writers:
                    key = writer.peer.target.key
                    if writer.slot is None or key in self._checking:
                        continue
                    if now < self._next_check.get(key, 0.0):
                        continue
                    ask = asks.setdefault(key, (writer.peer, awaited.spec.remote, []))
                    ask[2].append(awaited.spec.base_request_id)
            for key in asks:
                self._checking.add(key)
                self._next_check[key] = now + PUSH_CHECK_S
            waited_on = {w.peer.target.key for a in self._awaited.values() for w in a.writers}
            for key in [key for key in self._next_check if key not in waited_on]:
                del self._next_check[key]
        for key, (peer, remote, requests) in asks.items():
            self._pool.submit(self._ask, key, peer, remote, requests)

    def _ask(
        self,
        key: tuple[str, int, str, int],
        peer: Peer,
        remote: RemoteEndpoint,
        requests: list[str],
    ) -> None:
        """Asks ``peer`` whether it gave up on any of ``requests``; fails those it did, or,
        where it does not answer or refuses (restarted), every request waiting on it."""
        try:
            reply = peer.client.request(
                PushStatusQuery(self._rank.cluster_id, tuple(requests)).to_dict()
            )
            gave_up = gave_up_in(reply, requests)
        except Exception as e:
            # Judged only while a request still waits on it, and not dropped meanwhile (what
            # waited on it was failed then).
            with self._lock:
                waits = any(w.peer is peer for a in self._awaited.values() for w in a.writers)
            if waits and self._rank.peers.linked(peer.target) is peer:
                rank = f"prefill rank {peer.target.rank} of {peer.engine_id}"
                self._lose(peer, remote, f"{rank}: {e}")
            return
        finally:
            with self._lock:
                self._checking.discard(key)
        with self._lock:
            failed = [a for a in self._awaited.values() if a.spec.base_request_id in gave_up]
            for awaited in failed:
                del self._awaited[awaited.spec.request_id]
        for awaited in failed:
            self._rank.outcomes.record("push_failures_heard")
            self._give_up(awaited, f"P gave up: {gave_up[awaited.spec.base_request_id].reason}")
        if any(g.relink for g in gave_up.values()):
            # P cannot write over this link again: the next request links anew.
            self._drop(peer, "the link was dropped: P lost it")

    def _lose(self, peer: Peer, remote: RemoteEndpoint, reason: str) -> None:
        """``peer`` is gone: every request waiting on it, for its word or to register with
        it (push.contact's verdict), fails now."""
        self._endpoints.lost(remote, reason)
        peer.client.close()  # registrations queued on it end now, and see the verdict
        self._drop(peer, f"P is gone: {reason}", "push_peers_lost")

    def _drop(self, peer: Peer, reason: str, counter: str | None = None) -> None:
        """Drops ``peer``'s link (the next request links again); every request waiting for
        a word over it fails, since nothing lands over a link torn down."""
        self._rank.peers.drop(peer)
        with self._lock:
            failed = [
                awaited
                for awaited in self._awaited.values()
                if any(w.peer is peer for w in awaited.writers)
            ]
            for awaited in failed:
                del self._awaited[awaited.spec.request_id]
        for awaited in failed:
            if counter is not None:
                self._rank.outcomes.record(counter)
            self._pool.submit(self._give_up, awaited, reason)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _register(self, spec: PushRecvSpec, queued_at: float) -> None:
        awaited = _Awaited(spec, registered_at=queued_at)
        try:
            try:
                self._offer(awaited, fresh=False)
            except (PushRefused, PeerLost):
                raise
            except Exception as e:
                self._endpoints.raise_if_lost(spec.remote, queued_at)
                if awaited.fresh:
                    raise
                # P may have restarted since D first contacted it (the router keeps naming
                # its old start): once more, from a first contact.
                logger.info("hixl: request %s: %s; contacting P again", spec.request_id, e)
                self._revoke(awaited)
                self._offer(awaited, fresh=True)
        except Exception as e:
            if isinstance(e, PeerLost):
                self._rank.outcomes.record("push_peers_lost")
            elif not isinstance(e, PushRefused):
                self._endpoints.forget(spec.remote)
            self._give_up(awaited, str(e))
            return
        if not spec.every_local_block:
            return  # P was told to free its blocks: nothing to wait for
        with self._lock:
            if spec.request_id not in self._cancelled:
                self._awaited[spec.request_id] = awaited
                return
        self._give_up(awaited, "aborted")

    def _offer(self, awaited: _Awaited, fresh: bool) -> None:
        """Links each P rank this rank mirrors a KV head of, grants it the blocks' heads it
        writes, and registers them with it (a P rank nobody reads hears of no blocks)."""
        spec = awaited.spec
        endpoint, learned = self._endpoints.get(spec.remote, fresh, awaited.registered_at)
        awaited.fresh |= learned
        awaited.slices = None  # learned from P's rank (a restarted P may differ)
        try:
            plan = self._rank.plans.rank_plan(spec.remote.tp_size)
        except ValueError as e:
            raise PushRefused(f"prefill engine {endpoint.engine_id}: {e}") from None
        # P told to free its blocks takes nothing: nothing of the state to refuse.
        states = self._state_runs(spec, plan) if spec.every_local_block else {}
        awaited.state_units = sum(run.count for runs in states.values() for run in runs)
        for p_rank in plan.notify:
            writer = Writer(self._rank.peers.get(endpoint.rank(p_rank)))
            awaited.writers.append(writer)
            heads = tuple(HeadRun(r.src_head, r.dst_head, r.count) for r in plan.reads_from(p_rank))
            takes = bool(spec.every_local_block and heads)
            state_runs = states.pop(p_rank, []) if takes else []
            if takes:
                if awaited.slices is None:
                    awaited.slices = self._slices(writer.peer)
                sliced = awaited.slices is not None
                units = [unit for run in state_runs for unit in range(run.dst, run.dst + run.count)]
                grant_writer(
                    self._rank.kv, self._words, writer, spec.local_block_ids, heads, sliced, units
                )
            message = PushRegistration(
                request=spec.base_request_id,
                cluster_id=self._rank.cluster_id,
                positions=spec.positions if takes else (),
                blocks=spec.local_block_ids if takes else (),
                grants=writer.cache_grants,
                word=(writer.slot or 0, writer.grants[-1] if writer.grants else 0),
                wait_s=self._rank.config.push_timeout_s,
                slices=awaited.slices if takes else None,
                heads=heads,
                units_per_block=self._rank.kv.caches[0].units_per_block,
                rank=self._rank.tp_rank,
                consumers=plan.consumers[p_rank],
                groups=spec.groups if takes else (),
                state_runs=tuple(state_runs),
                state_grant=writer.state_grant,
                num_tokens=spec.num_tokens if takes else 0,
            )
            try:
                writer.peer.client.request(message.to_dict())
            except SideChannelTimeout as e:
                reason = f"prefill rank {p_rank} of {endpoint.engine_id}: {e}"
                self._lose(writer.peer, spec.remote, reason)
                raise PeerLost(reason) from e
        self._rank.outcomes.record("push_registrations")

    def _state_runs(self, spec: PushRecvSpec, plan: RankPlan) -> dict[int, list[StateRun]]:
        """Per P rank, the runs of units of the request's state slots it writes here
        (StateLayout.writes); raises PushRefused where the states cannot move between
        the TP sizes, or one lies on a P rank this rank takes no KV heads from (``plan``)."""
        if not spec.state_block_ids:
            return {}
        state = self._rank.layout.state
        if state is None:
            raise PushRefused(
                f"request {spec.request_id} names state slots, and this engine's model has none"
            )
        try:
            writes = state.writes(spec.state_block_ids, spec.remote.tp_size, self._rank.tp_rank)
        except ShardMismatch as e:
            raise PushRefused(f"prefill engine {spec.remote.engine_id}: {e}") from None
        runs = {p: [StateRun(*run) for run in rank_runs] for p, rank_runs in writes.items()}
        elsewhere = sorted(p for p in runs if not plan.reads_from(p))
        if elsewhere:
            raise PushRefused(state_without_kv(elsewhere[0], spec.remote.engine_id))
        return runs

    def _slices(self, peer: Peer) -> Slices | None:
        """Where P's blocks are smaller, the slices of its blocks that make up one of this
        rank's; None for blocks of one size. Raises PushRefused for P's blocks larger."""
        try:
            ratio = blocks_per_block(peer.payload.block_sizes, self._rank.block_sizes)
            if ratio == 1:
                return None
            if self._rank.kv.slices is None:
                raise ValueError(
                    f"prefill block_size {list(peer.payload.block_sizes)}, decode block_size "
                    f"{list(self._rank.block_sizes)}: this KV layout is not registered in slices"
                )
            return Slices(ratio, self._rank.plans.slice_runs(peer.payload.block_sizes[0]))
        except ValueError as e:
            raise PushRefused(f"prefill engine {peer.engine_id}: {e}") from None

    def _landed(self, awaited: _Awaited, now: float) -> None:
        """P set the word: every block landed. Revoked before the report (a write under
        the word's grant may still be returning), then the blocks are vLLM's."""
        try:
            self._revoke(awaited)
        except Exception as e:
            self._pool.submit(self._give_up, awaited, f"revoke failed: {e}")
            return
        spec = awaited.spec
        layout = self._rank.layout
        nbytes = len(spec.local_block_ids) * layout.block_bytes * layout.num_tensors
        if layout.state is not None:
            nbytes += layout.state.moved_bytes(awaited.state_units)
        self._received(spec, nbytes, now - awaited.registered_at, now - awaited.registered_at)

    def _received(self, spec: PushRecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        """The blocks of ``spec`` hold P's KV for it: reports them."""
        with self._lock:
            self._started.discard(spec.request_id)
        self._rank.outcomes.record_pull(pull_s, ready_s, nbytes, len(spec.every_local_block))
        self._rank.outcomes.record("push_receives")
        self._rank.outcomes.finish(spec.request_id, True, spec.every_local_block)

    def _give_up(self, awaited: _Awaited, reason: str) -> None:
        """Revokes (waiting for any write under way), then reports a failed receive."""
        spec = awaited.spec
        while True:
            try:
                self._revoke(awaited)
                break
            except Exception as e:  # a write still under way: its blocks are not ours yet
                logger.warning("hixl: request %s: revoking its grants: %s", spec.request_id, e)
        with self._lock:
            self._cancelled.discard(spec.request_id)
            self._started.discard(spec.request_id)
        if not spec.every_local_block:
            if reason:
                logger.warning("hixl: request %s: P not told to free: %s", spec.request_id, reason)
            return
        if reason != "aborted":
            logger.error("hixl: KV push for request %s failed: %s", spec.request_id, reason)
        self._rank.outcomes.record("failed_push_receives")
        self._rank.outcomes.finish(spec.request_id, False, spec.every_local_block)

    def _revoke(self, awaited: _Awaited) -> None:
        """Revokes every writer's grants (guarded_write), then forgets the writers."""
        for writer in awaited.writers:
            revoke_writer(self._rank.kv, self._words, writer)
        awaited.writers.clear()
