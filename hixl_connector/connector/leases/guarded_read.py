"""The guarded read: why a read that raced with block reuse is never decoded.

Everything the guarantee rests on is here: the lease word and where it lives (``lease_word``,
``LeaseWords``: publish, clear), the one batch D reads (``guarded_batch``: words, blocks,
words) and the verdict on it (``verdict``). The engine runs the batch; nothing else decides.

**One memory kind.** Every word a read touches (P's lease words, D's scratch rows, push
words) lives in the memory the KV lives in, registered as the KV is: device memory on an NPU
(HCCS carries no host memory at all, RoCE only ``aclrtMallocHost`` memory), host memory on a
CPU. The words are a ``WordStore`` the worker allocates beside its KV; only the allocator
differs between platforms, so CI runs the very path Ascend runs. A store's writes have
landed in memory when they return (on a device: the copy's stream synchronised), and its
reads return what memory holds once every earlier transfer completed.

**The words.** The word is a hash of the lease id, the leased block ids and P's incarnation
(a random nonce drawn at each start), never ``CLEARED``: params that name other blocks
(forged or mixed up), or that come from an earlier start of P at the same address, match no
word. A lease id is never issued twice in one start. Only a process that owns the device can
write its memory, so P's *workers* publish and clear; P's scheduler only decides:

1. *Published before any D can name it.* When P's scheduler schedules the step that computes
   a remote-decode prompt to its end (its last chunk, with chunked prefill), it takes a free
   slot and a fresh lease id, computes the word over the prompt's blocks as vLLM holds them
   then, and puts (slot, word) in that step's connector metadata. Every TP rank writes the
   word in ``bind_connector_metadata``, before that step's forward. ``kv_transfer_params``
   leave the engine only from ``request_finished``, which vLLM calls while it processes that
   step's output: after every rank ran the step (vLLM gathers every rank's output, and the
   forward's collectives hold rank 0 until every rank began it), so after every rank's
   write landed. With async scheduling the output of a step is still processed after the
   step ran, so the order holds a step ahead too.
2. *Handed out only as published.* ``request_finished`` hands out params only when the
   request finished deliverable (length or stop) and its prompt's blocks are the ones the
   word was computed over; otherwise (an abort, a sliding window that dropped a block since)
   the slot's clear goes to the workers and no params leave: D computes the prompt itself.
3. *Cleared before the blocks can go.* A rank's worker clears its word when the lease ends
   (every D rank done, released, or expired) before it reports the request in
   ``finished_sending``; only then may vLLM free the blocks and a later forward write them.
   A word published for a request that never leased (preempted, aborted, finished
   otherwise) is cleared by the workers in the next step's ``bind``, before that step's
   forward, the first that may write blocks the request gave back; and since no params
   named it, no D reads under it meanwhile. Clears run before publications in a ``bind``,
   so a slot may pass to a new lease in the same step.
4. *A restart of P.* The words are allocated zeroed at each start; a new start draws a new
   incarnation, so no word of the old start can be matched by params of the old start.

**The read.** D reads, in one engine batch, the word of every P rank it reads from, the
blocks, then the words again (a seqlock), into a scratch row of its own (one row per read in
flight). Its verdict: every word read before must equal the word D computes from its params,
else P does not lease these blocks to it ("refused"); every word read after must equal it too,
else the lease ended while the blocks were read and they may hold another request's KV
("stale"). Either way nothing read is used. The row is zeroed before the batch is handed to
the engine (the zeroing has landed when ``zero`` returns), so a word pull that failed to land
reads as ``CLEARED``, never as a word an earlier read of the row left there; the verdict reads
the row back only after the whole batch completed (on a device, a copy to the host ordered
after it).

**Why that suffices.** Suppose a block D read was rewritten for another request before D's
read of it ended. The rewrite came after vLLM freed the block, which came after the rank
cleared the word; so the clear happened before that block read ended, and so before the
second word read began (the engine performs a batch's pulls one after the other, each
complete before the next begins). A word once cleared is never published again (the slot's
next lease has a fresh id, so another word), so the second read finds ``CLEARED`` or another
word: stale. A read that found the word both times saw blocks nobody rewrote.

**Memory ordering.** The chain above must hold where the CPU reorders memory accesses
(arm64, unlike x86's total store order). On P, the clear reaches vLLM's scheduler through
inter-process messages (locks and system calls: full barriers) before any rewrite. On D, the
native engine puts a full fence between consecutive pulls of a batch, so the second word's
load is not performed before the blocks' loads; over TCP, each pull's bytes arrive before D
asks for the next, and P's serving threads hand over through the kernel's socket locks.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

WORD_BYTES = 8
CLEARED = 0


def lease_word(lease_id: int, block_ids: Sequence[Sequence[int]], incarnation: int) -> int:
    """The word P's start ``incarnation`` publishes for a lease of these blocks (one list per
    KV-cache group); never CLEARED."""
    groups = [list(group) for group in block_ids]
    canonical = json.dumps([lease_id, groups, incarnation], separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=WORD_BYTES).digest()
    return int.from_bytes(digest, "little") or 1


class WordStore(Protocol):
    """64-bit words in the memory the KV lives in, registered with the engine at
    ``address``: writes have landed when they return; reads see every transfer that
    completed before the call."""

    @property
    def address(self) -> int: ...

    def __len__(self) -> int: ...

    def read(self, start: int, count: int) -> list[int]: ...

    def write(self, index: int, word: int) -> None: ...

    def zero(self, start: int, count: int) -> None: ...


class LeaseWords:
    """One P rank's lease words, one slot per lease; its worker publishes and clears them."""

    def __init__(self, store: WordStore) -> None:
        self.store = store

    @property
    def slots(self) -> int:
        return len(self.store)

    def publish(self, slot: int, word: int) -> None:
        """Vouches for a lease: ``word`` is its ``lease_word``."""
        self.store.write(slot, word)

    def clear(self, slot: int, word: int) -> None:
        """Ends the lease ``word`` vouches for; a slot already given to a newer lease keeps
        that lease's word."""
        if self[slot] == word:
            self.store.write(slot, CLEARED)

    def __getitem__(self, slot: int) -> int:
        return self.store.read(slot, 1)[0]


# D's scratch words: one row per read in flight, each MAX_LEASE_READERS words read before the
# blocks and as many after.
# Most prefill ranks one decode rank reads from (prefill TP / decode TP).
MAX_LEASE_READERS = 64
# Most reads a decode rank has in flight at once; more wait for one to end.
IN_FLIGHT_READS = 64
# Rows of the step thread's synchronous reads, after those: such reads never wait for a row an
# asynchronous read holds (more in one step settle the earlier ones first).
SYNC_ROWS = 8
ROW_WORDS = 2 * MAX_LEASE_READERS
SCRATCH_WORDS = (IN_FLIGHT_READS + SYNC_ROWS) * ROW_WORDS

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
    return row * ROW_WORDS


def guarded_batch(
    words: Sequence[tuple[int, int]],
    blocks: list[Pull],
    row: int,
    word_pull: Callable[[int, int, int], Pull],
    scratch: WordStore,
) -> GuardedPull[Pull]:
    """The batch for one read: lease word ``slot`` of each ``(remote_cluster_id, slot)`` in
    ``words``, then ``blocks``, then the words again; ``word_pull(cluster, slot, scratch
    index)`` makes the engine's pull of one word into ``scratch``, whose row it zeroes."""
    if len(words) > MAX_LEASE_READERS:
        raise ValueError(f"{len(words)} prefill ranks per decode rank: at most {MAX_LEASE_READERS}")
    first = first_word(row)
    scratch.zero(first, ROW_WORDS)
    before = [word_pull(c, slot, first + i) for i, (c, slot) in enumerate(words)]
    after = [word_pull(c, slot, first + MAX_LEASE_READERS + i) for i, (c, slot) in enumerate(words)]
    return GuardedPull(before + blocks + after, len(words), row)


def words_read(scratch: WordStore, pull: GuardedPull[Pull]) -> tuple[list[int], list[int]]:
    """The lease words as ``pull`` read them into ``scratch`` before and after the blocks:
    read back once the whole batch completed."""
    row = scratch.read(pull.first_word, ROW_WORDS)
    return row[: pull.words], row[MAX_LEASE_READERS : MAX_LEASE_READERS + pull.words]


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


class GuardedReads(Generic[Pull]):
    """One decode rank's guarded reads, whole: the scratch rows their words land in
    (``rows``: a read holds one from its batch's making until its verdict), a read's batch
    (word, blocks, word) and its verdict once the engine ran that batch. ``word_pull(cluster,
    slot, scratch index)`` makes the engine's pull of one lease word into ``scratch``."""

    def __init__(self, scratch: WordStore, word_pull: Callable[[int, int, int], Pull]) -> None:
        self.rows = ScratchRows()
        self._scratch = scratch
        self._word_pull = word_pull

    def batch(
        self, words: Sequence[tuple[int, int]], blocks: list[Pull], row: int
    ) -> GuardedPull[Pull]:
        """The batch of one read in scratch row ``row`` (``guarded_batch``)."""
        return guarded_batch(words, blocks, row, self._word_pull, self._scratch)

    def words(self, pull: GuardedPull[Pull]) -> tuple[list[int], list[int]]:
        """The lease words ``pull`` read before and after the blocks (``words_read``)."""
        return words_read(self._scratch, pull)

    def verdict(self, pull: GuardedPull[Pull], expected: int) -> tuple[str, int]:
        """The verdict on ``pull``, whose batch completed (``verdict``)."""
        return verdict(expected, *self.words(pull))
