"""P's lease words: one 64-bit word per lease slot, in shared memory, that D reads around
its pull, so the lease check rides on the transfer instead of a round trip to P's Python.

P's scheduler takes a free slot when it leases a finished prefill and writes the lease id
into that slot of every TP rank's words, before ``kv_transfer_params`` leave the engine: a
lease is valid by the time D can name it. A rank's worker clears its word when its lease ends
(every D rank done, released, or expired), before it reports the request finished, so vLLM
frees the blocks only after the word stopped vouching for them. The scheduler frees the slot
once every rank reported it.

The word is not the lease id itself but a hash of it and of the leased block ids
(``lease_word``), so a D whose ``kv_transfer_params`` name other blocks (forged, or mixed up)
finds no match and reads nothing. D reads the word, the blocks, then the word again (a
seqlock): both equal to its own means the blocks were leased to it for the whole read (P
clears a word before reuse and never issues a lease id twice). Each rank's words are a file
in /dev/shm mapped by the worker (which registers it with the engine, for D to read) and by
the scheduler; stdlib only.
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


def lease_word(lease_id: int, block_ids: Sequence[Sequence[int]]) -> int:
    """The word P publishes for a lease of these blocks (one list per KV-cache group); never
    CLEARED."""
    canonical = json.dumps([lease_id, [list(group) for group in block_ids]], separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=WORD_BYTES).digest()
    return int.from_bytes(digest, "little") or 1


def words_path(engine_id: str, dp_rank: int, tp_rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
    return SHM_DIR / f"hixl-leases-{safe}-dp{dp_rank}-tp{tp_rank}"


class LeaseWords:
    """A mapped array of lease words. The worker ``create``s (and finally ``unlink``s) it;
    the scheduler ``open``s it."""

    def __init__(self, path: Path, fd: int, slots: int) -> None:
        self.path = path
        self.slots = slots
        try:
            self._map = mmap.mmap(fd, slots * WORD_BYTES)
        finally:
            os.close(fd)
        self._words = (ctypes.c_uint64 * slots).from_buffer(self._map)

    @classmethod
    def create(cls, path: Path, slots: int) -> LeaseWords:
        if slots < 1:
            raise ValueError(f"lease words need at least one slot, got {slots}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, slots * WORD_BYTES)
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
        if size < WORD_BYTES or size % WORD_BYTES:
            os.close(fd)
            raise ValueError(f"lease words {path} hold {size} bytes, not whole words")
        return cls(path, fd, size // WORD_BYTES)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._words)

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
