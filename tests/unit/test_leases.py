"""LeaseTable: every lease ends exactly once, by consumers' "done" or by expiry."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.leases import LeaseTable


def test_done_by_all_consumers_finishes_once() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, (1, 2, 3), now=0)
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=0) == "held"
    assert table.take_finished() == set()
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=1) == "finished"
    assert table.take_finished() == {"r1"}
    assert table.take_finished() == set()
    assert table.consumer_done("r1", 7, consumers=2, now=2, rank=0) == "unknown"
    assert len(table) == 0


def test_a_rank_counts_once_however_often_it_notifies() -> None:
    """A "done" whose reply was lost, then a "release" from the same rank: still one rank."""
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, (1, 2), now=0)
    for _ in range(3):
        assert table.consumer_done("r1", 7, consumers=2, now=1, rank=1) == "held"
    assert table.take_finished() == set()
    assert table.consumer_done("r1", 7, consumers=2, now=1, rank=0) == "finished"
    # The same before the lease starts: early notices count ranks too.
    assert table.consumer_done("r2", 8, consumers=2, now=1, rank=0) == "early"
    assert table.consumer_done("r2", 8, consumers=2, now=1, rank=0) == "early"
    table.start("r2", 8, (3,), now=2)
    assert table.take_finished() == {"r1"}
    assert table.consumer_done("r2", 8, consumers=2, now=2, rank=1) == "finished"


def test_wrong_lease_id_is_ignored() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, (1,), now=0)
    assert table.consumer_done("r1", 8, consumers=1, now=1, rank=0) == "unknown"
    assert not table.heartbeat("r1", 8, now=1)
    assert table.is_held("r1", 7) and not table.is_held("r1", 8)
    assert table.take_finished() == set()


def test_expiry_and_heartbeat() -> None:
    table = LeaseTable(lease_s=10)
    table.start("r1", 1, (1,), now=0)
    table.start("r2", 2, (2,), now=0)
    assert table.heartbeat("r2", 2, now=8)
    assert table.expire(now=10) == ["r1"]
    assert table.take_finished() == {"r1"}
    assert table.expire(now=17.9) == []
    assert table.expire(now=18) == ["r2"]
    assert table.take_finished() == {"r2"}


def test_done_before_lease_start_is_applied() -> None:
    table = LeaseTable(lease_s=10)
    assert table.consumer_done("r1", 3, consumers=1, now=0, rank=0) == "early"
    table.start("r1", 3, (4, 5), now=0.5)
    assert table.take_finished() == {"r1"}
    assert len(table) == 0


def test_early_notice_for_other_lease_does_not_finish() -> None:
    table = LeaseTable(lease_s=10)
    table.consumer_done("r1", 3, consumers=1, now=0, rank=0)
    table.start("r1", 4, (4,), now=0.5)
    assert table.take_finished() == set()
    assert table.is_held("r1", 4)


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
            table.start(request_id, n, (n,), now)
        elif op == "done":
            table.consumer_done(request_id, n, consumers=1, now=now, rank=0)
        elif op == "beat":
            table.heartbeat(request_id, n, now)
        else:
            table.expire(now)
        finished.extend(table.take_finished())
    table.expire(now + 1e9)
    finished.extend(table.take_finished())
    assert sorted(finished) == sorted(started)
    assert len(table) == 0


def test_check_vouches_only_for_the_leased_blocks_of_a_live_lease() -> None:
    table = LeaseTable(lease_s=10)
    assert table.check("r1", 5, (1, 2), now=0) == "early"  # SendSpec not yet delivered
    table.start("r1", 5, (1, 2, 3), now=0)
    assert table.check("r1", 5, (2, 3), now=9) == "held"
    assert table.expire(now=18) == []  # the check renewed the lease to 9 + 10
    assert table.check("r1", 5, (3, 4), now=9) == "foreign"
    assert table.check("r1", 6, (1,), now=9) == "unknown"
    assert table.expire(now=19) == ["r1"]
    assert table.check("r1", 5, (1,), now=20) == "unknown"  # ended: never vouched for again


def test_done_after_expiry_is_not_a_good_read() -> None:
    table = LeaseTable(lease_s=1)
    table.start("r1", 5, (1,), now=0)
    table.expire(now=2)
    assert table.consumer_done("r1", 5, consumers=1, now=2, rank=0) == "unknown"
