"""Bounds of the integers that cross process boundaries, and the one integer check."""

from __future__ import annotations

from typing import Any

MAX_U64 = 2**64 - 1
MAX_CLUSTER_ID = 2**63 - 1  # LLM-DataDist cluster ids are int64
MAX_PORT = 65535


def is_int(value: Any) -> bool:
    """An int and not a bool: True as a port or a block id is a typo, never intent."""
    return isinstance(value, int) and not isinstance(value, bool)
