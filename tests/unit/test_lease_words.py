"""Lease words: P's scheduler publishes, P's worker clears, D compares; real shared memory."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.leases.words import CLEARED, LeaseWords, lease_word, words_path


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
