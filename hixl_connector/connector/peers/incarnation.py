"""P's incarnation (its start nonce), handed from P's scheduler to its workers.

The scheduler draws the nonce; every lease word and every set of params carries it, and each
worker announces it in its handshakes and checks it in every side-channel request. The
workers start first and each creates a file of one word in /dev/shm; the scheduler writes the
nonce into every rank's file once, when vLLM builds it. The file is local to the host and
never registered with an engine: no fabric moves it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NONCE_BYTES = 8


def incarnation_path(engine_id: str, dp_rank: int, tp_rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
    return SHM_DIR / f"hixl-incarnation-{safe}-dp{dp_rank}-tp{tp_rank}"


class IncarnationFile:
    """One rank's nonce, mapped: the worker ``create``s (and finally ``unlink``s) it, the
    scheduler ``open``s it and writes the nonce. 0 until written."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            self._map = mmap.mmap(fd, NONCE_BYTES)
        finally:
            os.close(fd)
        self._word = ctypes.c_uint64.from_buffer(self._map)

    @classmethod
    def create(cls, path: Path) -> IncarnationFile:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, NONCE_BYTES)
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd)

    @classmethod
    def open(cls, path: Path) -> IncarnationFile:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} does not exist: the prefill workers create it when they register "
                "their KV caches"
            ) from None
        size = os.fstat(fd).st_size
        if size != NONCE_BYTES:
            os.close(fd)
            raise ValueError(f"{path} holds {size} bytes, not a {NONCE_BYTES}-byte nonce")
        return cls(path, fd)

    @property
    def nonce(self) -> int:
        return int(self._word.value)

    @nonce.setter
    def nonce(self, value: int) -> None:
        self._word.value = value

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        del self._word
        self._map.close()
