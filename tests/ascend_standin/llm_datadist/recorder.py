"""What the stand-in saw, for the tests: the documented calls in order, and the keyword
arguments of every ``pull_blocks`` (CANN reads those with ``dict.get``, so a misspelt one is
dropped without a word; the contract test checks the connector never sends one)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_calls: list[str] = []
_pull_kwargs: list[tuple[str, ...]] = []


def record(name: str) -> None:
    with _lock:
        _calls.append(name)


def record_pull_kwargs(names: tuple[str, ...]) -> None:
    with _lock:
        _pull_kwargs.append(names)


def calls() -> list[str]:
    """The documented API calls made in this process, in order."""
    with _lock:
        return list(_calls)


def pull_kwargs() -> list[tuple[str, ...]]:
    """The sorted keyword names of each ``pull_blocks`` call made in this process."""
    with _lock:
        return list(_pull_kwargs)
