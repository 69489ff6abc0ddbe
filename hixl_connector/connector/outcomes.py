"""Where D's receivers (pulls and pushes) report, from any thread, and the step thread
collects: receives that ended, blocks of synchronous loads that failed, the statistics, and
the one event that wakes an idle step when any of these changes."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from hixl_connector.connector.stats import HixlKVConnectorStats


@dataclass(frozen=True)
class _Outcome:
    request_id: str
    ok: bool
    block_ids: tuple[int, ...]  # where the KV was to land


@dataclass(frozen=True)
class TransferResults:
    """What ended since the last step. A failed receive is in ``finished_recving`` too;
    ``failed_blocks`` are its blocks (for vLLM that takes failures as load errors)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    failed_blocks: set[int]


class Outcomes:
    def __init__(self) -> None:
        self._ended: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._load_errors: set[int] = set()  # blocks of failed synchronous reads, not yet told
        self._load_errors_lock = threading.Lock()
        self._stats = HixlKVConnectorStats()
        self._stats_lock = threading.Lock()  # pool threads record while vLLM collects
        # A receive ended or a lease may have finished: an idle step stops waiting.
        self.wake = threading.Event()

    def record(self, counter: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats.record(counter, n)

    def record_pull(self, pull_s: float, ready_s: float, nbytes: int, blocks: int) -> None:
        with self._stats_lock:
            self._stats.record_pull(pull_s, ready_s, nbytes, blocks)

    def finish(self, request_id: str, ok: bool, block_ids: tuple[int, ...]) -> None:
        """A receive ended (ok or not): reported at the next ``results``, which it wakes."""
        self._ended.put(_Outcome(request_id, ok, block_ids))
        self.wake.set()

    def invalidate(self, block_ids: tuple[int, ...]) -> None:
        """A synchronous read failed: its blocks hold no KV."""
        with self._load_errors_lock:
            self._load_errors.update(block_ids)

    def pending(self) -> bool:
        """Whether a receive ended that ``results`` has not reported yet."""
        return not self._ended.empty()

    def results(self, finished_sending: set[str]) -> TransferResults:
        """The receives that ended since the last call, with P's ``finished_sending``."""
        recving: set[str] = set()
        failed: set[str] = set()
        failed_blocks: set[int] = set()
        while True:
            try:
                outcome = self._ended.get_nowait()
            except queue.Empty:
                break
            recving.add(outcome.request_id)
            if not outcome.ok:
                failed.add(outcome.request_id)
                failed_blocks.update(outcome.block_ids)
        return TransferResults(finished_sending, recving, failed, failed_blocks)

    def take_load_errors(self) -> set[int]:
        """Blocks of synchronous reads that failed since the last call: they hold no KV."""
        with self._load_errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> HixlKVConnectorStats | None:
        """What was recorded since the last call; None when nothing was."""
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            snapshot, self._stats = self._stats, HixlKVConnectorStats()
            return snapshot
