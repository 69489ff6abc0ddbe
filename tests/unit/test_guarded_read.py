"""The guarded read: P's scheduler publishes lease words, P's worker clears them (real shared
memory); D's batch reads word, blocks, word, and the verdict takes only a read vouched for
before and after."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.leases.guarded_read import (
    CLEARED,
    IN_FLIGHT_READS,
    MAX_LEASE_READERS,
    SCRATCH_WORDS,
    SYNC_ROWS,
    LeaseWords,
    ScratchRows,
    first_word,
    guarded_batch,
    lease_word,
    verdict,
    words_path,
    words_read,
)


@pytest.fixture
def path() -> Iterator[Path]:
    path = words_path(f"test-{uuid.uuid4()}", 0, 1)
    yield path
    path.unlink(missing_ok=True)


def test_the_scheduler_sees_what_the_worker_registered(path: Path) -> None:
    worker = LeaseWords.create(path, 16)
    scheduler = LeaseWords.open(path)
    scheduler.unlink()  # both keep their mappings
    assert not path.exists() and scheduler.slots == 16
    scheduler.publish(3, 0xFEED)
    assert worker[3] == 0xFEED  # the memory D reads through the worker's registration
    assert worker.address != scheduler.address
    worker.clear(3, 0xBEEF)  # another lease's word stays
    assert scheduler[3] == 0xFEED
    worker.clear(3, 0xFEED)
    assert scheduler[3] == CLEARED
    worker.close()
    scheduler.close()


def test_missing_or_malformed_words_are_named(path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="prefill workers create them"):
        LeaseWords.open(path)
    path.write_bytes(b"x" * 12)
    with pytest.raises(ValueError, match="12 bytes, not slots and a nonce"):
        LeaseWords.open(path)
    with pytest.raises(ValueError, match="at least one slot"):
        LeaseWords.create(path, 0)


def test_engine_ids_become_safe_file_names() -> None:
    assert words_path("a/b c", 2, 3).name == "hixl-leases-a_b_c-dp2-tp3"


block_lists = st.lists(st.lists(st.integers(0, 2**40), max_size=8), min_size=1, max_size=3)


@given(st.integers(0, 2**64 - 1), block_lists, st.integers(1, 2**64 - 1))
def test_a_word_is_never_cleared_and_binds_lease_blocks_and_incarnation(
    lease: int, blocks: list, incarnation: int
) -> None:
    word = lease_word(lease, blocks, incarnation)
    assert word != CLEARED and 0 < word < 2**64
    # As D parses them:
    assert word == lease_word(lease, [tuple(group) for group in blocks], incarnation)
    assert lease_word((lease + 1) % 2**64, blocks, incarnation) != word
    # The same lease id and blocks from another start of P (restarted at the same address):
    assert lease_word(lease, blocks, incarnation % (2**64 - 1) + 1) != word
    forged = [[b + 1 for b in group] for group in blocks]
    if forged != blocks:
        assert lease_word(lease, forged, incarnation) != word


def test_the_incarnation_lies_after_the_slots(tmp_path: Path) -> None:
    """P's scheduler writes it; the workers read it; it is not a slot D can read."""
    path = tmp_path / "words"
    words = LeaseWords.create(path, 4)
    assert words.slots == 4 and words.incarnation == 0
    seen = LeaseWords.open(path)
    assert seen.slots == 4
    seen.incarnation = 0xABC
    assert words.incarnation == 0xABC
    assert [words[slot] for slot in range(4)] == [0, 0, 0, 0]
    assert path.stat().st_size == 5 * 8


@given(
    readers=st.integers(1, MAX_LEASE_READERS),
    row=st.integers(0, SCRATCH_WORDS // (2 * MAX_LEASE_READERS) - 1),
    blocks=st.integers(0, 5),
)
def test_the_batch_reads_every_word_before_and_after_every_block(
    readers: int, row: int, blocks: int
) -> None:
    scratch = [0xDEAD] * SCRATCH_WORDS  # what earlier reads of any row left
    words = [(100 + i, 7 + i) for i in range(readers)]
    block_pulls = [("blocks", b) for b in range(blocks)]

    def word_pull(cluster: int, slot: int, index: int) -> tuple[str, int, int, int]:
        return ("word", cluster, slot, index)

    pull = guarded_batch(words, list(block_pulls), row, word_pull, scratch)
    first = first_word(row)
    assert pull.pulls[:readers] == [("word", c, s, first + i) for i, (c, s) in enumerate(words)]
    assert pull.pulls[readers : readers + blocks] == block_pulls
    after = [("word", c, s, first + MAX_LEASE_READERS + i) for i, (c, s) in enumerate(words)]
    assert pull.pulls[readers + blocks :] == after
    # This read's words start CLEARED: a word pull that never lands cannot vouch.
    assert words_read(scratch, pull) == ([CLEARED] * readers, [CLEARED] * readers)
    touched = {first + i for i in range(readers)} | {
        first + MAX_LEASE_READERS + i for i in range(readers)
    }
    assert all(scratch[i] == 0xDEAD for i in range(SCRATCH_WORDS) if i not in touched)


def test_more_readers_than_a_row_holds_are_refused() -> None:
    scratch = [0] * SCRATCH_WORDS
    with pytest.raises(ValueError, match=f"at most {MAX_LEASE_READERS}"):
        guarded_batch([(1, 1)] * (MAX_LEASE_READERS + 1), [], 0, lambda *a: a, scratch)


WORD = lease_word(5, [[1, 2]], 9)


@given(
    st.lists(st.sampled_from([WORD, CLEARED, WORD ^ 1]), min_size=1, max_size=4).flatmap(
        lambda before: st.tuples(
            st.just(before),
            st.lists(
                st.sampled_from([WORD, CLEARED, WORD ^ 1]),
                min_size=len(before),
                max_size=len(before),
            ),
        )
    )
)
def test_only_a_read_vouched_for_before_and_after_by_every_reader_passes(
    words: tuple[list[int], list[int]],
) -> None:
    before, after = words
    outcome, reader = verdict(WORD, before, after)
    if any(word != WORD for word in before):
        assert (outcome, reader) == ("refused", [w != WORD for w in before].index(True))
    elif any(word != WORD for word in after):
        assert (outcome, reader) == ("stale", [w != WORD for w in after].index(True))
    else:
        assert (outcome, reader) == ("vouched", -1)


def test_scratch_rows_are_never_shared_and_the_steps_rows_are_its_own() -> None:
    rows = ScratchRows()
    held = [rows.take_now() for _ in range(IN_FLIGHT_READS)]
    assert sorted(r for r in held if r is not None) == list(range(IN_FLIGHT_READS))
    assert rows.take_now() is None  # every asynchronous row in flight
    step = [rows.take_for_step() for _ in range(SYNC_ROWS)]
    assert sorted(r for r in step if r is not None) == list(
        range(IN_FLIGHT_READS, IN_FLIGHT_READS + SYNC_ROWS)
    )
    assert rows.take_for_step() is None
    closing = threading.Event()
    closing.set()
    assert rows.take(closing) is None  # a waiting read gives up at shutdown
    rows.give_back(step[0] or 0)
    rows.give_back(held[3] or 0)
    assert rows.take_now() == held[3] and rows.take_for_step() == step[0]
    assert all(
        first_word(r) + 2 * MAX_LEASE_READERS <= SCRATCH_WORDS
        for r in range(IN_FLIGHT_READS + SYNC_ROWS)
    )
