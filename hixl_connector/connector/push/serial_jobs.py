"""Jobs that must run one after another (one request's writes: every layer before the word
that vouches for them), on a pool that runs other requests' jobs beside them."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor


class SerialJobs:
    """Runs submitted jobs in submission order, one at a time, on ``pool``: at most one of
    the pool's threads at a time, and none while nothing is queued. A job must not raise
    (it reports its own failure): the queue would stop behind it."""

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._jobs: deque[Callable[[], None]] = deque()
        self._running = False

    def submit(self, job: Callable[[], None]) -> None:
        """Queues ``job``; raises RuntimeError once the pool shut down."""
        with self._lock:
            self._jobs.append(job)
            if self._running:
                return  # the thread draining the queue takes it
            self._running = True
        try:
            self._pool.submit(self._drain)
        except RuntimeError:
            with self._lock:
                self._running = False
                self._jobs.clear()
            raise

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._running = False
                    return
                job = self._jobs.popleft()
            job()
