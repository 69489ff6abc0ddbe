"""D side of the lease protocol: the notices D sends P, "done", "release" and "heartbeat",
all off the pull threads (P's side: lease_server; the messages: lease_messages).

Best effort: P's lease expiry frees the blocks anyway; only promptness is lost. They run on
their own threads, never queued behind pulls, so a stalled pull cannot let the leases of
other waiting requests expire. Each linked P rank has a lane (a thread) of its own while it
has notices pending, so one stalled P cannot delay another's heartbeats; addresses no
handshake vouched for (named by clients in kv_transfer_params, maybe dead) share one lane,
so they cannot hold up linked peers nor grow the number of threads.

Heartbeats: one message per peer carries every lease D still waits on there, at most every
`heartbeat_s`, and never while the previous one to that peer is in flight: an unreachable P
must not pile up work for the others. Peers are named by kv_transfer_params, i.e. by clients,
so a peer is tracked only while a waiting request names it or its heartbeat is in flight;
nothing is kept from history, and the state never outgrows the requests D is waiting on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.lease_messages import (
    MAX_NOTIFICATION_ITEMS,
    LeaseNotice,
    Notification,
)
from hixl_connector.connector.metadata import PeerRank, ReleaseSpec, RemoteEndpoint
from hixl_connector.connector.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)


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
    ) -> None:
        self._client_for = client_for
        self._is_linked = is_linked
        self._targets = targets
        self._rank = rank
        self._record = record  # counts "failed_notifications"
        self._heartbeats = HeartbeatSchedule(heartbeat_s)
        self._linked = PeerLanes()
        self._unlinked = ThreadPoolExecutor(1, thread_name_prefix="hixl-notices-new")

    def release_later(self, spec: ReleaseSpec, kind: str = "release") -> None:
        """Queues a notice to every P rank this D rank answers for: "done" after a good read,
        "release" when nothing was or will be read (nothing to pull, aborted first, failed).
        P frees on either."""
        for target, consumers in self._ranks(spec.remote):
            self._submit(
                target,
                self._release_rank,
                target,
                spec.remote_request_id,
                spec.lease_id,
                consumers,
                kind,
            )

    def _release_rank(
        self,
        target: PeerRank,
        remote_request_id: str,
        lease_id: int,
        consumers: int,
        kind: str,
    ) -> None:
        notice = LeaseNotice(remote_request_id, lease_id, consumers, rank=self._rank)
        try:
            client, owned = self._client_for(target)
        except (ValueError, RuntimeError) as e:
            logger.warning("hixl: %s for %s not sent: %s", kind, remote_request_id, e)
            return
        try:
            client.request(Notification(kind, (notice,)).to_dict())
        except SideChannelError as e:
            self._record("failed_notifications")
            logger.warning("hixl: %s for %s not delivered: %s", kind, remote_request_id, e)
        finally:
            if owned:
                client.close()

    def heartbeats(self, beats: list[tuple[RemoteEndpoint, str, int]], now: float) -> None:
        """Schedules this step's heartbeats for the leases D still waits on, to every P rank
        that holds one of them for this D rank."""
        per_rank = [
            (target, remote_request_id, lease_id)
            for remote, remote_request_id, lease_id in beats
            for target, _ in self._ranks(remote)
        ]
        for due in self._heartbeats.due(per_rank, now):
            self._submit(due.target, self._heartbeat, due)

    def tracked_peers(self) -> int:
        return self._heartbeats.tracked_peers()

    def shutdown(self) -> None:
        self._linked.shutdown()
        self._unlinked.shutdown(wait=True, cancel_futures=True)

    def _ranks(self, remote: RemoteEndpoint) -> list[tuple[PeerRank, int]]:
        try:
            return [(remote.rank(p), n) for p, n in self._targets(remote).items()]
        except ValueError as e:  # params named ranks or ports that cannot exist
            logger.warning("hixl: no lease notice to %s: %s", remote.engine_id, e)
            return []

    def _submit(self, target: PeerRank, task: Callable[..., None], *args: Any) -> None:
        if self._is_linked(target):
            self._linked.submit(target.key, task, *args)
        else:
            self._unlinked.submit(task, *args)

    def _heartbeat(self, due: DueHeartbeat) -> None:
        try:
            client, owned = self._client_for(due.target)
            try:
                for first in range(0, len(due.items), MAX_NOTIFICATION_ITEMS):
                    batch = due.items[first : first + MAX_NOTIFICATION_ITEMS]
                    client.request(Notification("heartbeat", batch).to_dict())
            finally:
                if owned:
                    client.close()
        except Exception as e:  # a lost heartbeat costs a lease, never the worker
            self._record("failed_notifications")
            logger.warning("hixl: heartbeat to %s failed: %s", due.target.remote.engine_id, e)
        finally:
            self._heartbeats.finished(due.key)


class PeerLanes:
    """A single-thread lane per key, alive while it has tasks pending: tasks for one peer run
    in order, and a peer that stalls holds up only its own."""

    def __init__(self) -> None:
        self._lanes: dict[Any, tuple[ThreadPoolExecutor, int]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, key: Any, task: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._closed:
                return
            lane, pending = self._lanes.get(key) or (
                ThreadPoolExecutor(1, thread_name_prefix="hixl-notices"),
                0,
            )
            self._lanes[key] = (lane, pending + 1)
            future = lane.submit(task, *args)
        future.add_done_callback(lambda _: self._finished(key))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def shutdown(self) -> None:
        """Drops what is still queued and waits for what runs (each task is bounded)."""
        with self._lock:
            self._closed = True
            lanes = [lane for lane, _ in self._lanes.values()]
        for lane in lanes:
            lane.shutdown(wait=True, cancel_futures=True)

    def _finished(self, key: Any) -> None:
        with self._lock:
            lane, pending = self._lanes[key]
            if pending > 1:
                self._lanes[key] = (lane, pending - 1)
                return
            del self._lanes[key]
        lane.shutdown(wait=False)  # its thread ends after this task


PeerKey = tuple[str, str, int]  # (engine_id, side-channel host, port of the rank)


@dataclass(frozen=True)
class DueHeartbeat:
    key: PeerKey
    target: PeerRank
    items: tuple[LeaseNotice, ...]


class HeartbeatSchedule:
    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last_sent: dict[PeerKey, float] = {}
        self._in_flight: set[PeerKey] = set()
        self._lock = threading.Lock()  # the step thread schedules, the control thread finishes

    def due(self, beats: list[tuple[PeerRank, str, int]], now: float) -> list[DueHeartbeat]:
        """The heartbeats to send now for this step's waiting leases (marked in flight)."""
        waiting: dict[PeerKey, list[LeaseNotice]] = {}
        targets: dict[PeerKey, PeerRank] = {}
        for target, remote_request_id, lease_id in beats:
            key = target.key
            waiting.setdefault(key, []).append(LeaseNotice(remote_request_id, lease_id))
            targets[key] = target
        due = []
        with self._lock:
            # A peer no waiting request names any more is forgotten: its next heartbeat, if it
            # ever gets one, merely goes out a little early.
            self._last_sent = {
                key: sent_at
                for key, sent_at in self._last_sent.items()
                if key in waiting or key in self._in_flight
            }
            for key, items in waiting.items():
                if key in self._in_flight:
                    continue
                sent_at = self._last_sent.get(key)
                if sent_at is not None and now - sent_at < self._interval_s:
                    continue
                self._last_sent[key] = now
                self._in_flight.add(key)
                due.append(DueHeartbeat(key, targets[key], tuple(items)))
        return due

    def finished(self, key: PeerKey) -> None:
        """The heartbeat to `key` was delivered or failed; the next one may be scheduled."""
        with self._lock:
            self._in_flight.discard(key)

    def tracked_peers(self) -> int:
        with self._lock:
            return len(self._last_sent.keys() | self._in_flight)
