"""HeartbeatSchedule: one heartbeat per peer per interval, one in flight, nothing from history."""

from __future__ import annotations

from hixl_connector.connector.lease_client import HeartbeatSchedule
from hixl_connector.connector.lease_messages import LeaseNotice
from hixl_connector.connector.metadata import PeerRank, RemoteEndpoint


def _remote(port: int, engine_id: str = "p-engine") -> PeerRank:
    return RemoteEndpoint(engine_id, "127.0.0.1", port, 1, 0).rank(0)


def test_one_message_per_peer_carries_all_its_leases() -> None:
    schedule = HeartbeatSchedule(interval_s=1.0)
    beats = [(_remote(7000), "a", 1), (_remote(7001), "b", 2), (_remote(7000), "c", 3)]
    due = {d.target.port: d.items for d in schedule.due(beats, now=0.0)}
    assert due == {
        7000: (LeaseNotice("a", 1), LeaseNotice("c", 3)),
        7001: (LeaseNotice("b", 2),),
    }


def test_rate_limited_per_peer_and_never_two_in_flight() -> None:
    schedule = HeartbeatSchedule(interval_s=1.0)
    beats = [(_remote(7000), "a", 1)]
    (first,) = schedule.due(beats, now=0.0)
    assert schedule.due(beats, now=5.0) == []  # the first is still in flight
    schedule.finished(first.key)
    assert schedule.due(beats, now=5.5) != []
    assert schedule.due(beats, now=5.9) == []  # in flight again
    schedule.finished(first.key)
    assert schedule.due(beats, now=6.0) == []  # within the interval of the last one
    assert len(schedule.due(beats, now=6.5)) == 1


def test_peers_are_forgotten_once_no_waiting_request_names_them() -> None:
    schedule = HeartbeatSchedule(interval_s=1.0)
    for round_ in range(20):  # 20 x 500 distinct client-named addresses
        beats = [(_remote(10_000 + i, f"fake-{round_}"), f"r{i}", i) for i in range(500)]
        due = schedule.due(beats, now=float(round_))
        assert len(due) == 500
        assert schedule.tracked_peers() == 500  # all in flight
        for heartbeat in due:
            schedule.finished(heartbeat.key)
        # Next step: those requests got their KV (or failed); none names these peers now.
        assert schedule.due([], now=round_ + 0.5) == []
        assert schedule.tracked_peers() == 0


def test_an_in_flight_peer_is_kept_until_it_finishes() -> None:
    schedule = HeartbeatSchedule(interval_s=1.0)
    (heartbeat,) = schedule.due([(_remote(7000), "a", 1)], now=0.0)
    schedule.due([], now=0.1)
    assert schedule.tracked_peers() == 1  # still in flight: not scheduled twice if named again
    assert schedule.due([(_remote(7000), "a", 1)], now=2.0) == []
    schedule.finished(heartbeat.key)
    schedule.due([], now=2.1)
    assert schedule.tracked_peers() == 0
