"""The guarded read: why a read that raced with block reuse is never decoded.

Everything the guarantee rests on is here: the lease word and where it lives (``lease_word``,
``LeaseWords``: publish, clear), the one batch D reads (``guarded_batch``: words, blocks,
words) and the verdict on it (``verdict``). The engine runs the batch; nothing else decides.

**The words.** P's scheduler takes a free slot when it leases a finished prefill and writes
the lease's word into that slot of every TP rank's words before ``kv_transfer_params`` leave
the engine, so a lease is valid by the time D can name it. The word is a hash of the lease id,
the leased block ids and P's incarnation (a random nonce drawn at each start), never
``CLEARED``: params that name other blocks (forged or mixed up), or that come from an earlier
start of P at the same address, match no word. A lease id is never issued twice in one start.
A rank's worker clears its word when the lease ends (every D rank done, released, or
expired) before it reports the request finished; only then may vLLM free the blocks and a
later forward write them. Each rank's words are a file in /dev/shm mapped by the worker
(which registers it with the engine, for D to read) and by the scheduler; the incarnation
sits after the last slot, where the workers read it for their handshake, unregistered, so D
cannot read it.

**The read.** D reads, in one engine batch, the word of every P rank it reads from, the
blocks, then the words again (a seqlock), into a scratch row of its own (one row per read in
flight). Its verdict: every word read before must equal the word D computes from its params,
else P does not lease these blocks to it ("refused"); every word read after must equal it too,
else the lease ended while the blocks were read and they may hold another request's KV
("stale"). Either way nothing read is used.

**Why that suffices.** Suppose a block D read was rewritten for another request before D's
read of it ended. The rewrite came after vLLM freed the block, which came after the rank
cleared the word; so the clear happened before that block read ended, and so before the
second word read began (the engine performs a batch's pulls one after the other, each
complete before the next begins). A word once cleared is never published again (the slot's
next lease has a fresh id, so another word), so the second read finds ``CLEARED`` or another
word: stale. A read that found the word both times saw blocks nobody rewrote. The scratch row
is zeroed before each read, so a word pull that failed to land reads as ``CLEARED``, never as
a word an earlier read of the row left there.

**Memory ordering.** The chain above must hold where the CPU reorders memory accesses
(arm64, unlike x86's total store order). On P, the clear reaches vLLM's scheduler through
inter-process messages (locks and system calls: full barriers) before any rewrite. On D, the
native engine puts a full fence between consecutive pulls of a batch, so the second word's
load is not performed before the blocks' loads; over TCP, each pull's bytes arrive before D
asks for the next, and P's serving threads hand over through the kernel's socket locks.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import queue
import re
import threading
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

WORD_BYTES = 8
CLEARED = 0
SHM_DIR = Path("/dev/shm")


def lease_word(lease_id: int, block_ids: Sequence[Sequence[int]], incarnation: int) -> int:
    """The word P's start ``incarnation`` publishes for a lease of these blocks (one list per
    KV-cache group); never CLEARED."""
    groups = [list(group) for group in block_ids]
    canonical = json.dumps([lease_id, groups, incarnation], separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=WORD_BYTES).digest()
    return int.from_bytes(digest, "little") or 1


def words_path(engine_id: str, dp_rank: int, tp_rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
    return SHM_DIR / f"hixl-leases-{safe}-dp{dp_rank}-tp{tp_rank}"


class LeaseWords:
    """A mapped array of lease words, then P's incarnation. The worker ``create``s (and
    finally ``unlink``s) it; the scheduler ``open``s it."""

    def __init__(self, path: Path, fd: int, slots: int) -> None:
        self.path = path
        self.slots = slots
        try:
            self._map = mmap.mmap(fd, (slots + 1) * WORD_BYTES)
        finally:
            os.close(fd)
        self._words = (ctypes.c_uint64 * (slots + 1)).from_buffer(self._map)

    @classmethod
    def create(cls, path: Path, slots: int) -> LeaseWords:
        if slots < 1:
            raise ValueError(f"lease words need at least one slot, got {slots}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, (slots + 1) * WORD_BYTES)
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd, slots)

    @classmethod
    def open(cls, path: Path) -> LeaseWords:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"lease words {path} do not exist: the prefill workers create them when they "
                "register their KV caches"
            ) from None
        size = os.fstat(fd).st_size
        if size < 2 * WORD_BYTES or size % WORD_BYTES:
            os.close(fd)
            raise ValueError(f"lease words {path} hold {size} bytes, not slots and a nonce")
        return cls(path, fd, size // WORD_BYTES - 1)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._words)

    @property
    def incarnation(self) -> int:
        """P's start nonce; 0 until P's scheduler wrote it."""
        return int(self._words[self.slots])

    @incarnation.setter
    def incarnation(self, nonce: int) -> None:
        self._words[self.slots] = nonce

    def publish(self, slot: int, word: int) -> None:
        """Vouches for a lease: ``word`` is its ``lease_word``."""
        self._words[slot] = word

    def clear(self, slot: int, word: int) -> None:
        """Ends the lease ``word`` vouches for; a slot the scheduler already gave to a newer
        lease keeps that lease's word."""
        if self._words[slot] == word:
            self._words[slot] = CLEARED

    def __getitem__(self, slot: int) -> int:
        return int(self._words[slot])

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        del self._words
        self._map.close()


# D's scratch words: one row per read in flight, each MAX_LEASE_READERS words read before the
# blocks and as many after.
# Most prefill ranks one decode rank reads from (prefill TP / decode TP).
MAX_LEASE_READERS = 64
# Most reads a decode rank has in flight at once; more wait for one to end.
IN_FLIGHT_READS = 64
# Rows of the step thread's synchronous reads, after those: such reads never wait for a row an
# asynchronous read holds (more in one step settle the earlier ones first).
SYNC_ROWS = 8
SCRATCH_WORDS = (IN_FLIGHT_READS + SYNC_ROWS) * 2 * MAX_LEASE_READERS

Pull = TypeVar("Pull")


class ScratchRows:
    """The scratch rows one decode rank reads lease words into: ``IN_FLIGHT_READS`` for
    asynchronous reads (any thread), then ``SYNC_ROWS`` of the step thread's own, so an
    synchronous read never waits for an asynchronous one. A row is held from the batch's making
    until its verdict."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for row in range(IN_FLIGHT_READS):
            self._free.put(row)
        self._step = list(range(IN_FLIGHT_READS, IN_FLIGHT_READS + SYNC_ROWS))

    def take_now(self) -> int | None:
        """An asynchronous read's row, or None when all are in flight."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def take(self, closing: threading.Event) -> int | None:
        """An asynchronous read's row, waiting while all are in flight; None once
        ``closing`` is set."""
        while not closing.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def take_for_step(self) -> int | None:
        """One of the step thread's rows, or None when this step's reads hold them all."""
        return self._step.pop() if self._step else None

    def give_back(self, row: int) -> None:
        if row >= IN_FLIGHT_READS:
            self._step.append(row)
        else:
            self._free.put(row)


@dataclass(frozen=True)
class GuardedPull(Generic[Pull]):
    """``words`` lease-word pulls, the block pulls, and the ``words`` pulls again; the words
    land in scratch row ``row``: from ``first_word`` on (before) and ``first_word +
    MAX_LEASE_READERS`` on (after)."""

    pulls: list[Pull]
    words: int
    row: int

    @property
    def first_word(self) -> int:
        return first_word(self.row)


def first_word(row: int) -> int:
    """The first scratch word of row ``row``: words before the blocks, then those after."""
    return row * 2 * MAX_LEASE_READERS


def guarded_batch(
    words: Sequence[tuple[int, int]],
    blocks: list[Pull],
    row: int,
    word_pull: Callable[[int, int, int], Pull],
    scratch: MutableSequence[int],
) -> GuardedPull[Pull]:
    """The batch for one read: lease word ``slot`` of each ``(remote_cluster_id, slot)`` in
    ``words``, then ``blocks``, then the words again; ``word_pull(cluster, slot, scratch
    index)`` makes the engine's pull of one word into ``scratch``, whose row it zeroes."""
    if len(words) > MAX_LEASE_READERS:
        raise ValueError(f"{len(words)} prefill ranks per decode rank: at most {MAX_LEASE_READERS}")
    first = first_word(row)
    for i in range(len(words)):
        scratch[first + i] = scratch[first + MAX_LEASE_READERS + i] = CLEARED
    before = [word_pull(c, slot, first + i) for i, (c, slot) in enumerate(words)]
    after = [word_pull(c, slot, first + MAX_LEASE_READERS + i) for i, (c, slot) in enumerate(words)]
    return GuardedPull(before + blocks + after, len(words), row)


def words_read(scratch: Sequence[int], pull: GuardedPull[Pull]) -> tuple[list[int], list[int]]:
    """The lease words as ``pull`` read them into ``scratch`` before and after the blocks."""
    first, count = pull.first_word, pull.words
    before = [int(scratch[first + i]) for i in range(count)]
    after = [int(scratch[first + MAX_LEASE_READERS + i]) for i in range(count)]
    return before, after


def verdict(expected: int, before: Sequence[int], after: Sequence[int]) -> tuple[str, int]:
    """("vouched", -1) when every word read before and after the blocks is ``expected``;
    ("refused", i) when reader i's first word is not (P does not lease these blocks to this
    request); ("stale", i) when its second is not (the lease ended during the read)."""
    for i, word in enumerate(before):
        if word != expected:
            return "refused", i
    for i, word in enumerate(after):
        if word != expected:
            return "stale", i
    return "vouched", -1
