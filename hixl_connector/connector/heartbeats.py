"""D side: which prefill peers get a lease heartbeat this step.

One heartbeat message per peer carries every lease D still waits on there, at most every
`heartbeat_s`, and never while the previous one to that peer is in flight: an unreachable P
must not pile up work for the others. Peers are named by kv_transfer_params, i.e. by clients,
so a peer is tracked only while a waiting request names it or its heartbeat is in flight;
nothing is kept from history, and the state never outgrows the requests D is waiting on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hixl_connector.connector.metadata import PeerRank
from hixl_connector.connector.notifications import LeaseNotice

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
