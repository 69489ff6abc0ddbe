"""Bounds of the values that cross process boundaries, and the checks that hold them there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_U64 = 2**64 - 1
MAX_CLUSTER_ID = 2**63 - 1  # LLM-DataDist cluster ids are int64
MAX_PORT = 65535
MAX_KV_CACHE_GROUPS = 64
MAX_BLOCK_SIZE = 2**20
MAX_LEASE_SLOT = 2**32
# A unit of a state registration (state_layout), and the parts a model's states lie in (a
# part per plane of a state, per state group).
MAX_STATE_UNIT = 2**48
MAX_STATE_PARTS = 4 * MAX_KV_CACHE_GROUPS


def is_int(value: Any) -> bool:
    """An int and not a bool: True as a port or a block id is a typo, never intent."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_field(
    where: str,
    name: str,
    data: Any,
    kind: type,
    low: int | None = None,
    high: int | None = None,
) -> Any:
    """Returns ``data[name]`` (or ``data`` itself when it is not a mapping) if it is an int
    in [low, high] (``kind`` int) or a non-empty string (``kind`` str); else raises
    ValueError naming ``where``, the field and what it must be."""
    value: Any = data.get(name) if isinstance(data, Mapping) else data
    if kind is int:
        ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
        expected = "an int" + (f" >= {low}" if low is not None else "")
        expected += f" <= {high}" if high is not None else ""
    else:
        ok = isinstance(value, str) and bool(value)
        expected = "a non-empty string"
    if not ok:
        raise ValueError(f"{where} field {name!r} must be {expected}, got {value!r}")
    return value
