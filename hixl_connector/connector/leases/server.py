"""P side of the lease protocol: which prefilled requests still pin their blocks, and until
when (``LeaseTable``), and ``LeaseServer``, which answers D's notices on the side channel and
ends leases (D's side: lease_client; the messages: lease_messages).

A lease starts when P's scheduler hands a finished prefill to the worker (SendSpec); its lease
word already vouches for it, published by the workers in the step that computed the prompt
(leases.guarded_read). It ends when every expected D rank said "done" (or "release"), counted
by distinct rank so a repeated notice (a lost reply, then a release) never stands in for
another rank, or when no heartbeat
arrived for `lease_s` seconds. Either way the worker clears its lease word, then reports the
request in `finished_sending` exactly once, and vLLM frees its blocks. Pure and
clock-injected, so it is unit-tested without processes.

A "done" can overtake its SendSpec: P returns `kv_transfer_params` to the router in the same
step that queues the SendSpec, and a fast D may pull and notify before P's next step. Such
early notifications are parked (bounded in number and age) and applied when the lease starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.connector.leases.messages import LeaseNotice, Notification
from hixl_connector.connector.metadata import SendSpec

logger = logging.getLogger(__name__)

_EARLY_NOTICE_LIMIT = 4096
_ENDED_MEMORY = 4096


@dataclass
class Lease:
    request_id: str
    lease_id: int
    slot: int  # its lease word: cleared when the lease ends
    word: int
    expires_at: float
    ranks_done: set[int] = field(default_factory=set)
    consumers_expected: int = 1
    pins: int = 0  # push mode: pushes reading its blocks now, so it outlives expiry


@dataclass
class _EarlyNotice:
    lease_id: int
    consumers: int
    ranks_done: set[int]
    received_at: float


@dataclass
class LeaseTable:
    lease_s: float
    _leases: dict[str, Lease] = field(default_factory=dict)
    _early: dict[str, _EarlyNotice] = field(default_factory=dict)
    _finished: list[Lease] = field(default_factory=list)
    # Recently ended leases, so a late or repeated notice is not parked as an early one.
    _ended: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(
        self, request_id: str, lease_id: int, now: float, slot: int = 0, word: int = 0
    ) -> None:
        with self._lock:
            lease = Lease(request_id, lease_id, slot, word, now + self.lease_s)
            self._leases[request_id] = lease
            early = self._early.pop(request_id, None)
            if early is not None and early.lease_id == lease_id:
                lease.consumers_expected = early.consumers
                lease.ranks_done = early.ranks_done
                self._finish_if_complete(lease)

    def heartbeat(self, request_id: str, lease_id: int, now: float) -> bool:
        """Extends a live lease; False when the lease is unknown or was replaced."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.lease_id != lease_id:
                return request_id in self._early
            lease.expires_at = max(lease.expires_at, now + self.lease_s)
            return True

    def consumer_done(
        self, request_id: str, lease_id: int, consumers: int, now: float, *, rank: int
    ) -> str:
        """Records D rank ``rank``'s "done"; returns "held", "finished", "early" or "unknown"."""
        consumers = max(1, consumers)
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return self._park_early(request_id, lease_id, consumers, rank, now)
            if lease.lease_id != lease_id:
                return "unknown"
            lease.consumers_expected = consumers
            lease.ranks_done.add(rank)
            return "finished" if self._finish_if_complete(lease) else "held"

    def pin(self, request_id: str, lease_id: int) -> bool:
        """Keeps the lease from expiring until as many ``pushed``; False when it ended."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.lease_id != lease_id:
                return False
            lease.pins += 1
            return True

    def pushed(self, request_id: str, lease_id: int, consumers: int, *, rank: int) -> None:
        """Push mode: the push to D rank ``rank`` ended (written, or never will be): one pin
        less, and that rank done; the lease ends once ``consumers`` D ranks are, unpinned."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.lease_id != lease_id:
                return
            lease.pins = max(0, lease.pins - 1)
            lease.consumers_expected = max(1, consumers)
            lease.ranks_done.add(rank)
            self._finish_if_complete(lease)

    def expire(self, now: float) -> list[str]:
        """Ends every lease past its deadline, but a pinned one; returns their request ids."""
        with self._lock:
            expired = [
                r for r, lease in self._leases.items() if lease.expires_at <= now and not lease.pins
            ]
            for request_id in expired:
                self._end(self._leases[request_id])
            stale = [r for r, e in self._early.items() if e.received_at + self.lease_s <= now]
            for request_id in stale:
                del self._early[request_id]
            return expired

    def take_finished(self) -> list[Lease]:
        """The leases that ended since the last call; their words are still published."""
        with self._lock:
            finished, self._finished = self._finished, []
            return finished

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _finish_if_complete(self, lease: Lease) -> bool:
        if len(lease.ranks_done) < lease.consumers_expected or lease.pins:
            return False
        self._end(lease)
        return True

    def _end(self, lease: Lease) -> None:
        del self._leases[lease.request_id]
        self._finished.append(lease)
        self._ended[lease.request_id] = lease.lease_id
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _park_early(
        self, request_id: str, lease_id: int, consumers: int, rank: int, now: float
    ) -> str:
        if self._ended.get(request_id) == lease_id:
            return "unknown"
        early = self._early.get(request_id)
        if early is not None and early.lease_id == lease_id:
            early.ranks_done.add(rank)
            return "early"
        if len(self._early) >= _EARLY_NOTICE_LIMIT:
            return "unknown"
        self._early[request_id] = _EarlyNotice(lease_id, consumers, {rank}, now)
        return "early"


class LeaseServer:
    """P's leases: started from the scheduler's SendSpecs, ended by D's "done"/"release"
    (``handlers``, on the side-channel thread) or by expiry (``finished``, on the step
    thread), which clears each one's lease word before reporting it. ``wake`` is called when
    a notice may have ended a lease; ``record`` counts "expired_leases"."""

    def __init__(
        self,
        lease_s: float,
        words: LeaseWords,
        record: Callable[[str, int], None],
        wake: Callable[[], None],
    ) -> None:
        self._table = LeaseTable(lease_s)
        self._words = words
        self._record = record
        self._wake = wake

    def start(self, sends: Iterable[SendSpec], now: float) -> None:
        for send in sends:
            self._table.start(send.request_id, send.lease_id, now, send.slot, send.word)

    def finished(self, now: float) -> set[str]:
        """The requests whose leases ended since the last call: their blocks may go."""
        expired = self._table.expire(now)
        for request_id in expired:
            logger.warning("hixl: lease of request %s expired; releasing its blocks", request_id)
        if expired:
            self._record("expired_leases", len(expired))
        finished = set()
        for lease in self._table.take_finished():
            # Cleared first: vLLM may hand the blocks to another request once it learns.
            self._words.clear(lease.slot, lease.word)
            finished.add(lease.request_id)
        return finished

    @property
    def table(self) -> LeaseTable:
        """Push mode pins and ends leases here (push.sender)."""
        return self._table

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """The side channel's handlers of D's notices."""
        return {"done": self._on_done, "release": self._on_done, "heartbeat": self._on_heartbeat}

    def _on_done(self, message: dict[str, Any]) -> dict[str, Any]:
        answer = _answer_each(
            message,
            lambda n, now: self._table.consumer_done(
                n.remote_request_id, n.lease_id, n.consumers, now, rank=n.rank
            ),
        )
        self._wake()
        return answer

    def _on_heartbeat(self, message: dict[str, Any]) -> dict[str, Any]:
        return _answer_each(
            message, lambda n, now: self._table.heartbeat(n.remote_request_id, n.lease_id, now)
        )


def _answer_each(
    message: dict[str, Any], answer: Callable[[LeaseNotice, float], Any]
) -> dict[str, Any]:
    """Validates a D -> P notification and answers each of its items, in order."""
    now = time.monotonic()
    return {"results": [answer(notice, now) for notice in Notification.from_dict(message).items]}
