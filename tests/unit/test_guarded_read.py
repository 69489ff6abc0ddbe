"""The guarded read: P's workers publish and clear lease words in the KV's memory kind; D's
batch reads word, blocks, word into a zeroed scratch row, and the verdict takes only a read
vouched for before and after."""

from __future__ import annotations

import ctypes
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.kv.word_memory import ALIGNMENT_BYTES, WordMemory
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
    words_read,
)
from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path


class DeviceWords(WordMemory):
    """The device path (torch operations, then a synchronisation) run on host memory: the
    same operations an NPU's words go through."""

    def __init__(self, count: int) -> None:
        super().__init__(count, "cpu")
        self._host = None


@pytest.mark.parametrize("memory", [WordMemory, DeviceWords])
def test_words_are_aligned_zeroed_and_read_back_as_written(memory: type) -> None:
    store = memory(16) if memory is DeviceWords else memory(16, "cpu")
    assert store.address % ALIGNMENT_BYTES == 0  # where HCCS may carry them
    assert len(store) == 16 and store.read(0, 16) == [CLEARED] * 16
    store.write(3, 2**64 - 1)  # the top bit set: stored in an int64 element
    store.write(4, 0xFEED)
    assert store.read(2, 3) == [0, 2**64 - 1, 0xFEED]
    store.zero(3, 2)
    assert store.read(0, 16) == [CLEARED] * 16
    # The bytes the engine moves are the words, little-endian, from the registered address:
    store.write(0, 0x0102030405060708)
    assert ctypes.c_uint64.from_address(store.address).value == 0x0102030405060708


def test_a_clear_leaves_a_newer_leases_word() -> None:
    words = LeaseWords(WordMemory(4, "cpu"))
    words.publish(3, 0xFEED)
    assert words[3] == 0xFEED and words.slots == 4
    words.clear(3, 0xBEEF)  # another lease's word stays
    assert words[3] == 0xFEED
    words.clear(3, 0xFEED)
    assert words[3] == CLEARED


def test_the_incarnation_goes_from_scheduler_to_worker_through_a_file_no_engine_sees() -> None:
    path = incarnation_path(f"test-{uuid.uuid4()}", 0, 1)
    worker = IncarnationFile.create(path)
    try:
        assert worker.nonce == 0  # until P's scheduler wrote it: every request refused
        scheduler = IncarnationFile.open(path)
        scheduler.unlink()  # both keep their mappings
        scheduler.nonce = 0xABC
        scheduler.close()
        assert not path.exists() and worker.nonce == 0xABC
    finally:
        path.unlink(missing_ok=True)
        worker.close()


def test_a_missing_or_malformed_incarnation_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="prefill workers create it"):
        IncarnationFile.open(tmp_path / "none")
    (tmp_path / "short").write_bytes(b"x" * 12)
    with pytest.raises(ValueError, match="12 bytes, not a 8-byte nonce"):
        IncarnationFile.open(tmp_path / "short")
    assert incarnation_path("a/b c", 2, 3).name == "hixl-incarnation-a_b_c-dp2-tp3"


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


@given(
    readers=st.integers(1, MAX_LEASE_READERS),
    row=st.integers(0, SCRATCH_WORDS // (2 * MAX_LEASE_READERS) - 1),
    blocks=st.integers(0, 5),
)
def test_the_batch_reads_every_word_before_and_after_every_block(
    readers: int, row: int, blocks: int
) -> None:
    scratch = WordMemory(SCRATCH_WORDS, "cpu")
    for i in range(SCRATCH_WORDS):  # what earlier reads of any row left
        scratch.write(i, 0xDEAD)
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
    # The row is this read's alone: every other row keeps what it held.
    row_words = range(first, first + 2 * MAX_LEASE_READERS)
    held = scratch.read(0, SCRATCH_WORDS)
    assert all(held[i] == 0xDEAD for i in range(SCRATCH_WORDS) if i not in row_words)


def test_more_readers_than_a_row_holds_are_refused() -> None:
    scratch = WordMemory(SCRATCH_WORDS, "cpu")
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
