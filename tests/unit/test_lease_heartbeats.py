"""HeartbeatSchedule: a lease is renewed once it went heartbeat_s without a word, one message
per peer, one in flight, nothing from history. The schedule is kept by changes (a request
begins or stops waiting); ``Waiting`` turns each step's set of waiting leases into them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.endpoints import PeerRank, RemoteEndpoint
from hixl_connector.connector.leases.client import DueHeartbeat, HeartbeatSchedule, PeerKey
from hixl_connector.connector.leases.messages import LeaseNotice


def _remote(port: int, engine_id: str = "p-engine") -> PeerRank:
    return RemoteEndpoint(engine_id, "127.0.0.1", port, 1, 0).rank(0)


class Waiting:
    """A schedule fed the way the worker feeds it: each step, the requests that began and
    stopped waiting since the last (a request here waits on one lease at one P rank)."""

    def __init__(self, interval_s: float) -> None:
        self.schedule = HeartbeatSchedule(interval_s)
        self._known: set[tuple[PeerRank, str, int]] = set()

    def due(self, beats: list[tuple[PeerRank, str, int]], now: float) -> list[DueHeartbeat]:
        current = set(beats)
        for target, rid, lease in self._known - current:
            self.schedule.end(f"{target.key}:{rid}:{lease}")
        for target, rid, lease in sorted(current - self._known, key=beats.index):
            self.schedule.start(
                f"{target.key}:{rid}:{lease}", [target], LeaseNotice(rid, lease), now
            )
        self._known = current
        return self.schedule.due(now)

    def finished(self, key: PeerKey) -> None:
        self.schedule.finished(key)

    def tracked_peers(self) -> int:
        return self.schedule.tracked_peers()


def test_a_lease_that_waits_less_than_the_interval_costs_no_heartbeat() -> None:
    schedule = Waiting(interval_s=1.0)
    beats = [(_remote(7000), "a", 1)]
    for now in (0.0, 0.3, 0.9):  # its KV arrives before the interval is up
        assert schedule.due(beats, now) == []
    assert schedule.due([], now=1.5) == []
    # A lease first seen later starts its own interval: the peer's history does not count.
    assert schedule.due([(_remote(7000), "b", 2)], now=1.6) == []
    assert len(schedule.due([(_remote(7000), "b", 2)], now=2.6)) == 1


def test_one_message_per_peer_carries_all_its_leases() -> None:
    schedule = Waiting(interval_s=1.0)
    beats = [(_remote(7000), "a", 1), (_remote(7001), "b", 2), (_remote(7000), "c", 3)]
    assert schedule.due(beats, now=0.0) == []
    newer = [*beats, (_remote(7000), "d", 4)]  # seen just now: carried along all the same
    due = {d.target.port: d.items for d in schedule.due(newer, now=1.0)}
    assert due == {
        7000: (LeaseNotice("a", 1), LeaseNotice("c", 3), LeaseNotice("d", 4)),
        7001: (LeaseNotice("b", 2),),
    }


def test_rate_limited_per_peer_and_never_two_in_flight() -> None:
    schedule = Waiting(interval_s=1.0)
    beats = [(_remote(7000), "a", 1)]
    assert schedule.due(beats, now=0.0) == []
    (first,) = schedule.due(beats, now=1.0)
    assert schedule.due(beats, now=5.0) == []  # the first is still in flight
    schedule.finished(first.key)
    assert schedule.due(beats, now=5.5) != []
    assert schedule.due(beats, now=5.9) == []  # in flight again
    schedule.finished(first.key)
    assert schedule.due(beats, now=6.0) == []  # within the interval of the last one
    assert len(schedule.due(beats, now=6.5)) == 1


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=40))
def test_a_peer_gets_at_most_one_heartbeat_per_interval(steps: list[tuple[int, int]]) -> None:
    """Whatever leases come and go, each heartbeat to a peer renews all its waiting leases,
    so the next one to it is an interval later at the earliest."""
    schedule = Waiting(interval_s=1.0)
    sent_at: dict[int, list[float]] = {}
    for step, (peer_count, lease_count) in enumerate(steps):
        now = step * 0.25
        beats = [
            (_remote(7000 + p), f"r{(step // 3 + i) % 7}", i)
            for p in range(peer_count)
            for i in range(lease_count)
        ]
        for heartbeat in schedule.due(beats, now):
            sent_at.setdefault(heartbeat.target.port, []).append(now)
            schedule.finished(heartbeat.key)
    for times in sent_at.values():
        assert all(b - a >= 1.0 for a, b in zip(times, times[1:], strict=False)), times


def test_leases_and_peers_are_forgotten_once_no_waiting_request_names_them() -> None:
    schedule = Waiting(interval_s=1.0)
    for round_ in range(20):  # 20 x 500 distinct client-named addresses
        beats = [(_remote(10_000 + i, f"fake-{round_}"), f"r{i}", i) for i in range(500)]
        assert schedule.due(beats, now=3.0 * round_) == []
        assert schedule.tracked_peers() == 500
        due = schedule.due(beats, now=3.0 * round_ + 1.0)
        assert len(due) == 500
        for heartbeat in due:
            schedule.finished(heartbeat.key)
        # Next step: those requests got their KV (or failed); none names these peers now.
        assert schedule.due([], now=3.0 * round_ + 1.5) == []
        assert schedule.tracked_peers() == 0


def test_an_in_flight_peer_is_kept_until_it_finishes() -> None:
    schedule = Waiting(interval_s=1.0)
    schedule.due([(_remote(7000), "a", 1)], now=0.0)
    (heartbeat,) = schedule.due([(_remote(7000), "a", 1)], now=1.0)
    schedule.due([], now=1.1)
    assert schedule.tracked_peers() == 1  # still in flight: not scheduled twice if named again
    assert schedule.due([(_remote(7000), "a", 1)], now=3.0) == []
    schedule.finished(heartbeat.key)
    schedule.due([], now=3.1)
    assert schedule.tracked_peers() == 0
