"""PullHandle: the result of ``CacheManager.pull_blocks_batch_async`` (a project extension).

The native backend wraps an engine handle; the ascend backend, whose CANN API has no async pull,
runs the pulls on a thread (see ``ThreadPullHandle``). Both behave the same way:
``poll()`` and ``wait(timeout)`` return True once the pull has landed, False while it runs, and
raise the pull's LLMException when it failed (again on every later call); ``finished_at`` is
when it ended, on ``time.monotonic``'s clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hixl_connector.datadist.api.status import LLMException, code_to_status

PENDING = 1  # the native engine's "not finished yet"
_WAIT_SLICE_MS = 1000


class _AsyncEngine(Protocol):
    def wait(self, handle: int, timeout_ms: int, timed: bool) -> tuple[int, str, int]: ...
    def poll(self, handle: int, timed: bool) -> tuple[int, str, int]: ...


class PullHandle:
    """An in-flight pull on the native engine."""

    def __init__(self, engine: _AsyncEngine, handle: int, call: str, description: str) -> None:
        self._engine = engine
        self._handle = handle
        self._call = call  # the API call that made the handle, as its errors name it
        self._description = description
        self._error: LLMException | None = None
        self._done = False
        self._finished_at: float | None = None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done or self._error is not None

    @property
    def finished_at(self) -> float | None:
        """When the pull ended (``time.monotonic``'s clock); None while it runs."""
        return self._finished_at

    def _settle(self, status: int, message: str, finished_ns: int) -> bool:
        if status == PENDING:
            return False
        self._finished_at = finished_ns / 1e9
        if status != 0:
            code = code_to_status(status)
            self._error = LLMException(
                f"[{self._call}] failed, error code is {code}, {self._description}: {message}.",
                status_code=code,
            )
            raise self._error
        self._done = True
        return True

    def _final(self) -> bool | None:
        if self._error is not None:
            raise self._error
        return True if self._done else None

    def poll(self) -> bool:
        with self._lock:
            final = self._final()
            if final is not None:
                return final
            return self._settle(*self._engine.poll(self._handle, timed=True))

    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (None: until the pull ends; it is itself bounded by
        sync_kv_timeout)."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            with self._lock:
                final = self._final()
                if final is not None:
                    return final
                left_ms = _WAIT_SLICE_MS
                if deadline is not None:
                    left_ms = min(left_ms, max(0, int((deadline - time.monotonic()) * 1000)))
                if self._settle(*self._engine.wait(self._handle, left_ms, timed=True)):
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


class ThreadPullHandle:
    """Pulls run on a daemon thread, for backends without an async pull."""

    def __init__(self, pull: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._finished_at: float | None = None
        self._thread = threading.Thread(
            target=self._run, args=(pull, args, kwargs), name="pull_blocks_batch_async", daemon=True
        )
        self._thread.start()

    def _run(self, pull: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            pull(*args, **kwargs)
        except BaseException as exc:  # handed to the waiter, who re-raises it
            self._error = exc
        finally:
            self._finished_at = time.monotonic()
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def finished_at(self) -> float | None:
        return self._finished_at

    def poll(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        if not self._finished.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True
