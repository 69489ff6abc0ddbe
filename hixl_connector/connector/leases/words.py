"""P's lease words: one 64-bit word per lease slot, in shared memory, that D reads around
its pull, so the lease check rides on the transfer instead of a round trip to P's Python.

P's scheduler takes a free slot when it leases a finished prefill and writes the lease id
into that slot of every TP rank's words, before ``kv_transfer_params`` leave the engine: a
lease is valid by the time D can name it. A rank's worker clears its word when its lease ends
(every D rank done, released, or expired), before it reports the request finished, so vLLM
frees the blocks only after the word stopped vouching for them. The scheduler frees the slot
once every rank reported it.

The word is not the lease id itself but a hash of it, of the leased block ids and of P's
incarnation (``lease_word``), so a D whose ``kv_transfer_params`` name other blocks (forged, or
mixed up), or come from an earlier start of P at the same address, finds no match and reads
nothing. The incarnation is a random nonce P's scheduler draws at each start and writes after
the last slot of every rank's words, where the workers read it for their handshake; that word
is not registered with the engine, so D cannot read it.

D reads the word, the blocks, then the word again (a seqlock): both equal to its own means the
blocks were leased to it for the whole read (P clears a word before reuse and never issues a
lease id twice in one start). Each rank's words are a file in /dev/shm mapped by the worker
(which registers it with the engine, for D to read) and by the scheduler; stdlib only.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import re
from collections.abc import Sequence
from pathlib import Path

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

    def publish(self, slot: int, lease_id: int) -> None:
        self._words[slot] = lease_id

    def clear(self, slot: int, lease_id: int) -> None:
        """Ends ``lease_id`` in its slot; a slot the scheduler already gave to a newer lease
        keeps its word."""
        if self._words[slot] == lease_id:
            self._words[slot] = CLEARED

    def __getitem__(self, slot: int) -> int:
        return int(self._words[slot])

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        del self._words
        self._map.close()
