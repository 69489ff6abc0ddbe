"""Runs: consecutive steps merged into one move, the one rule every planner here uses.

A step ``(key, src, dst)`` extends the last run iff it has the run's key and both its src and
dst follow the run's last; otherwise it starts a run. The native engine's planner merges
block pairs by the same rule (``plan_runs`` in native/src/common/planner.cpp, checked against this
in tests/engine/test_native_units.py), so what Python plans and what C++ copies agree.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def runs_of(steps: Iterable[tuple[K, int, int]]) -> list[tuple[K, int, int, int]]:
    """Maximal runs ``(key, src, dst, count)`` of ``steps``, in order."""
    runs: list[tuple[K, int, int, int]] = []
    for key, src, dst in steps:
        if runs:
            last_key, first_src, first_dst, count = runs[-1]
            if last_key == key and first_src + count == src and first_dst + count == dst:
                runs[-1] = (last_key, first_src, first_dst, count + 1)
                continue
        runs.append((key, src, dst, 1))
    return runs
