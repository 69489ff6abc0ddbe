"""LeaseTable: every lease ends exactly once, by consumers' "done" or by expiry."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.leases import LeaseTable


def finished(table: LeaseTable) -> set[str]:
    return {lease.request_id for lease in table.take_finished()}


def test_done_by_all_consumers_finishes_once() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, now=0)
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=0) == "held"
    assert finished(table) == set()
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=1) == "finished"
    assert finished(table) == {"r1"}
    assert finished(table) == set()
    assert table.consumer_done("r1", 7, consumers=2, now=2, rank=0) == "unknown"
    assert len(table) == 0


def test_a_rank_counts_once_however_often_it_notifies() -> None:
    """A "done" whose reply was lost, then a "release" from the same rank: still one rank."""
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, now=0)
    for _ in range(3):
        assert table.consumer_done("r1", 7, consumers=2, now=1, rank=1) == "held"
    assert finished(table) == set()
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=0) == "finished"
    # The same before the lease starts: early notices count ranks too.
    assert table.consumer_done("r2", 8, consumers=2, now=1, rank=0) == "early"
    assert table.consumer_done("r2", 8, consumers=2, now=1, rank=0) == "early"
    table.start("r2", 8, now=2)
    assert finished(table) == {"r1"}
    assert table.consumer_done("r2", 8, consumers=2, now=2, rank=1) == "finished"


def test_wrong_lease_id_is_ignored() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, now=0)
    assert table.consumer_done("r1", 8, consumers=1, now=1, rank=0) == "unknown"
    assert not table.heartbeat("r1", 8, now=1)
    assert table.heartbeat("r1", 7, now=1)
    assert finished(table) == set()


def test_expiry_and_heartbeat() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 1, now=0)
    table.start("r2", 2, now=0)
    assert table.heartbeat("r2", 2, now=8)
    assert table.expire(now=10) == ["r1"]
    assert finished(table) == {"r1"}
    assert table.expire(now=17.9) == []
    assert table.expire(now=18) == ["r2"]
    assert finished(table) == {"r2"}


def test_done_before_lease_start_is_applied() -> None:
    table = LeaseTable(lease_s=10)
    assert table.consumer_done("r1", 3, consumers=1, now=0, rank=0) == "early"
    table.start("r1", 3, now=0.5)
    assert finished(table) == {"r1"}
    assert len(table) == 0


def test_early_notice_for_other_lease_does_not_finish() -> None:
    table = LeaseTable(lease_s=10)
    table.consumer_done("r1", 3, consumers=1, now=0, rank=0)
    table.start("r1", 4, now=0.5)
    assert finished(table) == set()
    assert table.heartbeat("r1", 4, now=1) and len(table) == 1


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["start", "done", "beat", "expire"]),
            st.integers(0, 4),
            st.floats(0, 5),
        ),
        max_size=60,
    )
)
def test_each_started_lease_finishes_at_most_once(ops: list[tuple[str, int, float]]) -> None:
    table = LeaseTable(lease_s=3)
    now = 0.0
    started: set[str] = set()
    finished: list[str] = []
    for op, n, dt in ops:
        now += dt
        request_id = f"r{n}"
        if op == "start" and request_id not in started:
            started.add(request_id)
            table.start(request_id, n, now)
        elif op == "done":
            table.consumer_done(request_id, n, consumers=1, now=now, rank=0)
        elif op == "beat":
            table.heartbeat(request_id, n, now)
        else:
            table.expire(now)
        finished.extend(lease.request_id for lease in table.take_finished())
    table.expire(now + 1e9)
    finished.extend(lease.request_id for lease in table.take_finished())
    assert sorted(finished) == sorted(started)
    assert len(table) == 0


def test_an_ended_lease_names_the_word_to_clear() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 5, now=0, slot=3, word=0xABC)
    table.consumer_done("r1", 5, consumers=1, now=1, rank=0)
    (lease,) = table.take_finished()
    assert (lease.request_id, lease.slot, lease.word) == ("r1", 3, 0xABC)


def test_done_after_expiry_is_not_a_good_read() -> None:
    table = LeaseTable(lease_s=1)
    table.start("r1", 5, now=0)
    table.expire(now=2)
    assert table.consumer_done("r1", 5, consumers=1, now=2, rank=0) == "unknown"
