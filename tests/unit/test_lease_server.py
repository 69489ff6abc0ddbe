"""LeaseTable: every lease ends exactly once, by consumers' "done" or by expiry; LeaseServer
answers D's notices and clears each lease word before it reports the lease (real shared
memory)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from raw_side_channel import RawSideChannel

from hixl_connector.connector.kv.word_memory import WordMemory
from hixl_connector.connector.leases.guarded_read import CLEARED, LeaseWords
from hixl_connector.connector.leases.messages import LeaseNotice, Notification
from hixl_connector.connector.leases.server import LeaseServer, LeaseTable
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.peers.envelope import (
    REPLAY_WINDOW_S,
    Destination,
    seal_request,
)
from hixl_connector.connector.peers.side_channel import SideChannelServer

TOKEN = "lease-server-test-token-0123456789abcdef"


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


class Counters:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.wakes = 0

    def record(self, counter: str, n: int = 1) -> None:
        self.counts[counter] = self.counts.get(counter, 0) + n

    def wake(self) -> None:
        self.wakes += 1


@pytest.fixture
def words() -> LeaseWords:
    return LeaseWords(WordMemory(8, "cpu"))  # a CPU worker's: beside its KV, in host memory


def done(kind: str, request_id: str, lease_id: int, rank: int = 0) -> dict[str, Any]:
    return Notification(kind, (LeaseNotice(request_id, lease_id, 1, rank),)).to_dict()


def test_server_clears_the_word_before_it_reports_a_lease_done(words: LeaseWords) -> None:
    counters = Counters()
    server = LeaseServer(10.0, words, counters.record, counters.wake)
    handlers = server.handlers()
    words.publish(2, 0xAB)
    server.start([SendSpec("r1", 7, 2, 0xAB)], time.monotonic())
    assert server.finished(time.monotonic()) == set() and words[2] == 0xAB
    assert handlers["heartbeat"](Notification("heartbeat", (LeaseNotice("r1", 7),)).to_dict()) == {
        "results": [True]
    }
    assert handlers["done"](done("done", "r1", 7)) == {"results": ["finished"]}
    assert counters.wakes == 1
    assert words[2] == 0xAB  # still published until the step thread reports the lease
    assert server.finished(time.monotonic()) == {"r1"}
    assert words[2] == CLEARED and len(server._table) == 0
    assert server.finished(time.monotonic()) == set()  # reported exactly once


def test_server_ends_an_expired_lease_and_counts_it(words: LeaseWords) -> None:
    counters = Counters()
    server = LeaseServer(0.5, words, counters.record, counters.wake)
    words.publish(1, 0xCD)
    now = time.monotonic()
    server.start([SendSpec("r2", 9, 1, 0xCD)], now)
    assert server.handlers()["release"](done("release", "r2", 8)) == {"results": ["unknown"]}
    assert server.finished(now + 0.4) == set()
    assert server.finished(now + 0.6) == {"r2"}
    assert counters.counts == {"expired_leases": 1} and words[1] == CLEARED


def test_server_refuses_a_malformed_notice(words: LeaseWords) -> None:
    server = LeaseServer(1.0, words, Counters().record, Counters().wake)
    for bad in ({"type": "done", "items": [["r", -1, 1, 0]]}, {"type": "done"}, []):
        with pytest.raises(ValueError):
            server.handlers()["done"](bad)  # type: ignore[arg-type]


def test_a_heartbeat_replayed_while_its_send_time_passes_is_refused(words: LeaseWords) -> None:
    """D's clock runs 20 s ahead of P's. Its heartbeat is accepted once; the same bytes,
    replayed when P's clock has moved on by the window and a second (the send time still
    passes: it is 11 s old), are refused, and the lease ends ``lease_s`` after the genuine
    heartbeat, not after the replay."""
    lease_s = 1.0
    counters = Counters()
    leases = LeaseServer(lease_s, words, counters.record, counters.wake)
    me = Destination("p", 0, 0xA1)
    p_clock_ahead_by = {"s": 0.0}
    context = zmq.Context()
    channel = SideChannelServer(
        context,
        "127.0.0.1",
        0,
        leases.handlers(),
        lambda: me,
        TOKEN,
        clock=lambda: time.time() + p_clock_ahead_by["s"],
    )
    dealer = RawSideChannel(context, channel.port)
    send = dealer.ask
    try:
        words.publish(3, 0xEF)
        leases.start([SendSpec("r3", 11, 3, 0xEF)], time.monotonic())
        beat = Notification("heartbeat", (LeaseNotice("r3", 11),)).to_dict()
        captured = msgpack.packb(seal_request(beat, 1, me, TOKEN, time.time() + 20.0)[0])
        assert send(captured)["results"] == [True]
        answered_at = time.monotonic()
        time.sleep(0.3)
        p_clock_ahead_by["s"] = REPLAY_WINDOW_S + 1.0
        replay = send(captured)
        assert not replay["ok"] and "replayed request" in replay["error"], replay
        assert leases.finished(answered_at + lease_s + 0.01) == {"r3"}
        assert counters.counts == {"expired_leases": 1} and words[3] == CLEARED
    finally:
        dealer.close()
        channel.close()
        context.term()


def test_a_pinned_lease_outlives_expiry_until_it_is_pushed() -> None:
    """Push mode: P's blocks are read by a push under way, so expiry must not free them."""
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, now=0)
    assert not table.pin("r1", 8)  # another lease of it: not this one
    assert table.pin("r1", 7)
    assert table.expire(now=100) == [] and len(table) == 1
    table.pushed("r1", 8, 1, rank=0)
    assert len(table) == 1
    table.pushed("r1", 7, 1, rank=0)
    assert finished(table) == {"r1"}
    assert not table.pin("r1", 7)  # ended: a late push must not start


def test_a_lease_pushed_to_several_d_ranks_ends_with_the_last_push() -> None:
    """P's TP smaller than D's: each D rank registers for its heads, and P's blocks stay
    until every one of them was pushed, the pushes under way included."""
    table = LeaseTable(lease_s=10)
    table.start("r1", 7, now=0)
    assert table.pin("r1", 7) and table.pin("r1", 7)
    table.pushed("r1", 7, 2, rank=1)
    table.pushed("r1", 7, 2, rank=1)  # the same rank again: still one of two
    assert len(table) == 1 and table.expire(now=100) == ["r1"]  # unpinned: it may expire
    table.start("r2", 8, now=0)
    assert table.pin("r2", 8)
    table.pushed("r2", 8, 2, rank=0)
    assert table.pin("r2", 8)  # rank 1's push begins
    assert len(table) == 1
    table.pushed("r2", 8, 2, rank=1)
    assert finished(table) == {"r1", "r2"}
