"""D side of the lease protocol: the notices D sends P, "done", "release" and "heartbeat",
all off the pull threads (P's side: leases.server; the messages: leases.messages).

Best effort: P's lease expiry frees the blocks anyway; only promptness is lost. They run on
their own threads, never queued behind pulls, so a stalled pull cannot let the leases of
other waiting requests expire. Each linked P rank has a lane (a thread) of its own, so one
stalled P cannot delay another's notices; addresses no handshake vouched for (named by
clients in kv_transfer_params, maybe dead) share one lane, so they cannot hold up linked
peers nor grow the number of threads. A lane stays for `LANE_IDLE_S` after its last notice,
so a busy peer's notices never wait for a thread to start, and sends the notices of one kind
queued for one peer as one message: under load a "done" per request costs P one message per
batch, not one per request.

Heartbeats renew the leases D still waits on: one message per peer carries every such lease
there, once one of them has gone `heartbeat_s` without a word from D (counted from when D
first saw it), and never while the previous one to that peer is in flight. A request whose
KV arrives within `heartbeat_s`, the usual case, costs no heartbeat at all. Peers are named
by kv_transfer_params, i.e. by clients, so a lease is tracked only while a waiting request
names it and a peer only while it has one or its heartbeat is in flight: nothing is kept
from history, and the state never outgrows the requests D is waiting on.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hixl_connector.connector.endpoints import PeerRank, RemoteEndpoint
from hixl_connector.connector.leases.messages import (
    MAX_NOTIFICATION_ITEMS,
    LeaseNotice,
    Notification,
)
from hixl_connector.connector.metadata import ReleaseSpec, WaitingRead
from hixl_connector.connector.peers.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)

# How long a lane's thread waits for the next notice before it ends.
LANE_IDLE_S = 10.0
# The lane shared by addresses no handshake vouched for.
UNLINKED_LANE = ("", "", -1)


class LeaseClient:
    """``client_for(target)``: the client to use and whether to close it after (a linked
    peer's persistent client is shared); ``targets(remote)``: the P ranks this D rank
    notifies, each with the number of distinct D ranks that P rank waits for (see
    tp_mapping); ``rank``: this D rank."""

    def __init__(
        self,
        client_for: Callable[[PeerRank], tuple[SideChannelClient, bool]],
        is_linked: Callable[[PeerRank], bool],
        targets: Callable[[RemoteEndpoint], Mapping[int, int]],
        heartbeat_s: float,
        rank: int,
        record: Callable[[str], None],
        lane_idle_s: float = LANE_IDLE_S,
    ) -> None:
        self._client_for = client_for
        self._is_linked = is_linked
        self._targets = targets
        self._rank = rank
        self._record = record  # counts "failed_notifications"
        self._heartbeats = HeartbeatSchedule(heartbeat_s)
        self._lanes = PeerLanes(self._send, lane_idle_s)

    def notify(self, kind: str, spec: ReleaseSpec) -> None:
        """Queues a ``kind`` notice to every P rank this D rank answers for: "done" after a
        good read, "release" when nothing was or will be read (nothing to pull, aborted first,
        failed). P frees on either; the notice goes out on that rank's lane, never here."""
        for target, consumers in self._ranks(spec.remote):
            notice = LeaseNotice(spec.remote_request_id, spec.lease_id, consumers, self._rank)
            self._post(Outgoing(target, kind, (notice,)))

    def waiting(self, began: list[WaitingRead], ended: list[str], now: float) -> None:
        """This step's changes to the requests waiting for their KV, then the heartbeats
        that are due: to every P rank that holds a lease of theirs for this D rank. The
        step's cost follows the changes and the P ranks, not how many requests wait."""
        for request_id in ended:
            self._heartbeats.end(request_id)
        for read in began:
            notice = LeaseNotice(read.remote_request_id, read.lease_id)
            targets = [target for target, _ in self._ranks(read.remote)]
            self._heartbeats.start(read.request_id, targets, notice, now)
        for due in self._heartbeats.due(now):
            finished = functools.partial(self._heartbeats.finished, due.key)
            self._post(Outgoing(due.target, "heartbeat", due.items, finished))

    def shutdown(self) -> None:
        self._lanes.shutdown()

    def _ranks(self, remote: RemoteEndpoint) -> list[tuple[PeerRank, int]]:
        try:
            return [(remote.rank(p), n) for p, n in self._targets(remote).items()]
        except ValueError as e:  # params named ranks or ports that cannot exist
            logger.warning("hixl: no lease notice to %s: %s", remote.engine_id, e)
            return []

    def _post(self, outgoing: Outgoing) -> None:
        target = outgoing.target
        self._lanes.post(target.key if self._is_linked(target) else UNLINKED_LANE, outgoing)

    def _send(self, target: PeerRank, kind: str, items: tuple[LeaseNotice, ...]) -> None:
        """One message (or one per MAX_NOTIFICATION_ITEMS) of ``items`` to ``target``."""
        what = f"{kind} of {len(items)} lease(s)"
        try:
            client, owned = self._client_for(target)
        except (ValueError, RuntimeError) as e:
            logger.warning("hixl: %s to %s not sent: %s", what, target.remote.engine_id, e)
            return
        try:
            for first in range(0, len(items), MAX_NOTIFICATION_ITEMS):
                batch = items[first : first + MAX_NOTIFICATION_ITEMS]
                client.request(Notification(kind, batch).to_dict())
        except SideChannelError as e:  # a lost notice costs promptness, never the worker
            self._record("failed_notifications")
            logger.warning("hixl: %s to %s not delivered: %s", what, target.remote.engine_id, e)
        finally:
            if owned:
                client.close()


@dataclass(frozen=True)
class Outgoing:
    """Notices of one kind for one P rank; ``sent`` runs once they were sent (or failed)."""

    target: PeerRank
    kind: str
    items: tuple[LeaseNotice, ...]
    sent: Callable[[], None] | None = None


@dataclass
class _Lane:
    wake: threading.Condition
    queue: deque[Outgoing] = field(default_factory=deque)
    thread: threading.Thread | None = None


class PeerLanes:
    """One thread per key, alive while it has notices and ``idle_s`` after: a key's notices
    go in order, and a key that stalls holds up only its own. Consecutive notices of one
    kind for one P rank go out as one ``send``."""

    def __init__(
        self,
        send: Callable[[PeerRank, str, tuple[LeaseNotice, ...]], None],
        idle_s: float = LANE_IDLE_S,
    ) -> None:
        self._send = send
        self._idle_s = idle_s
        self._lanes: dict[Any, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def post(self, key: Any, outgoing: Outgoing) -> None:
        with self._lock:
            if self._closed:
                return
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(threading.Condition(self._lock))
                lane.thread = threading.Thread(
                    target=self._serve, args=(key, lane), name="hixl-notices", daemon=True
                )
                lane.thread.start()  # it takes the lock only once this post released it
            lane.queue.append(outgoing)
            lane.wake.notify()

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def shutdown(self) -> None:
        """Drops what is still queued and waits for what is being sent (each is bounded)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.queue.clear()
                lane.wake.notify()
        for lane in lanes:
            if lane.thread is not threading.current_thread():
                assert lane.thread is not None
                lane.thread.join()

    def _serve(self, key: Any, lane: _Lane) -> None:
        while True:
            with self._lock:
                if not lane.queue and not self._closed:
                    lane.wake.wait(self._idle_s)
                if not lane.queue:  # idle that long, or shut down: the lane ends
                    if self._lanes.get(key) is lane:
                        del self._lanes[key]
                    return
                batch = _take_batch(lane.queue)
            head = batch[0]
            try:
                items = tuple(item for outgoing in batch for item in outgoing.items)
                self._send(head.target, head.kind, items)
            except Exception:  # a bug must not end the lane with notices queued behind it
                logger.exception("hixl: %s notice to %s", head.kind, head.target.remote.engine_id)
            finally:
                for outgoing in batch:
                    if outgoing.sent is not None:
                        outgoing.sent()


def _take_batch(queue: deque[Outgoing]) -> list[Outgoing]:
    """The head of ``queue`` and the notices right behind it of its kind and P rank."""
    batch = [queue.popleft()]
    head = batch[0]
    count = len(head.items)
    while queue:
        nxt = queue[0]
        if nxt.kind != head.kind or nxt.target.key != head.target.key:
            break
        if count + len(nxt.items) > MAX_NOTIFICATION_ITEMS:
            break
        batch.append(queue.popleft())
        count += len(nxt.items)
    return batch


PeerKey = tuple[str, int, str, int]  # PeerRank.key: engine id, incarnation, host, port


@dataclass(frozen=True)
class DueHeartbeat:
    key: PeerKey
    target: PeerRank
    items: tuple[LeaseNotice, ...]


@dataclass
class _PeerLeases:
    """The waiting leases one P rank holds for this D rank, by D's request id, and when its
    next heartbeat is due."""

    target: PeerRank
    leases: dict[str, LeaseNotice]
    due_at: float


class HeartbeatSchedule:
    """Per P rank: a heartbeat is due once its oldest unrenewed lease has waited the
    interval; a heartbeat renews every lease there. Kept by changes (``start``, ``end``), so
    ``due`` costs one look per P rank."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._peers: dict[PeerKey, _PeerLeases] = {}
        self._of_request: dict[str, list[PeerKey]] = {}
        self._in_flight: set[PeerKey] = set()
        self._lock = threading.Lock()  # the step thread schedules, the lanes finish

    def start(
        self, request_id: str, targets: list[PeerRank], notice: LeaseNotice, now: float
    ) -> None:
        """``request_id`` waits on ``notice``'s lease at each of ``targets``."""
        self.end(request_id)
        with self._lock:
            for target in targets:
                peer = self._peers.get(target.key)
                if peer is None:
                    peer = self._peers[target.key] = _PeerLeases(target, {}, now + self._interval_s)
                peer.leases[request_id] = notice
                peer.due_at = min(peer.due_at, now + self._interval_s)
            self._of_request[request_id] = [target.key for target in targets]

    def end(self, request_id: str) -> None:
        """``request_id`` waits no more: its leases are forgotten, and a P rank with none."""
        with self._lock:
            for key in self._of_request.pop(request_id, ()):
                peer = self._peers.get(key)
                if peer is None:
                    continue
                peer.leases.pop(request_id, None)
                if not peer.leases:
                    del self._peers[key]

    def due(self, now: float) -> list[DueHeartbeat]:
        """The heartbeats to send now (marked in flight; never two to one P rank)."""
        due = []
        with self._lock:
            for key, peer in self._peers.items():
                if key in self._in_flight or peer.due_at > now:
                    continue
                peer.due_at = now + self._interval_s
                self._in_flight.add(key)
                due.append(DueHeartbeat(key, peer.target, tuple(peer.leases.values())))
        return due

    def finished(self, key: PeerKey) -> None:
        """The heartbeat to `key` was delivered or failed; the next one may be scheduled."""
        with self._lock:
            self._in_flight.discard(key)

    def tracked_peers(self) -> int:
        with self._lock:
            return len(set(self._peers) | self._in_flight)
