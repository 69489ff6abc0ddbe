"""The C types of CANN llm_datadist's arguments, checked with its exception types.

A wrong type raises TypeError, an int outside its C range raises ValueError. The rules of the
transfer calls (LLMException with LLM_PARAM_INVALID) are the table in ``rules.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

UINT16_MAX = 2**16 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
INVALID_ID = UINT64_MAX


def _type_names(classes: Iterable[type]) -> list[str]:
    return [cls.__name__ for cls in classes]


def check_isinstance(
    name: str,
    value: Any,
    classes: type | tuple[type, ...],
    inner: type | tuple[type, ...] | None = None,
    allow_none: bool = True,
) -> None:
    """TypeError unless ``value`` is one of ``classes`` (and, if given, every item ``inner``)."""
    if allow_none and value is None:
        return
    wanted = classes if isinstance(classes, tuple) else (classes,)
    if not isinstance(value, wanted):
        raise TypeError(f"{name} only support {_type_names(wanted)}, but got {type(value)}.")
    if inner is not None and isinstance(value, Iterable):
        inner_types = inner if isinstance(inner, tuple) else (inner,)
        for item in value:
            if not isinstance(item, inner_types):
                raise TypeError(
                    f"{name} inner type only support {_type_names(inner_types)}, "
                    f"but got {type(item)}."
                )


def _check_int_range(name: str, value: Any, low: int, high: int, c_type: str) -> None:
    check_isinstance(name, value, int, allow_none=False)
    if value < low or value > high:
        raise ValueError(f"{name}'s value is out of range, {value} is not a {c_type} value.")


def check_uint16(name: str, value: Any) -> None:
    _check_int_range(name, value, 0, UINT16_MAX, "uint16")


def check_int32(name: str, value: Any) -> None:
    _check_int_range(name, value, INT32_MIN, INT32_MAX, "int32")


def check_uint32(name: str, value: Any) -> None:
    _check_int_range(name, value, 0, UINT32_MAX, "uint32")


def check_int64(name: str, value: Any) -> None:
    _check_int_range(name, value, INT64_MIN, INT64_MAX, "int64")


def check_uint64(name: str, value: Any) -> None:
    _check_int_range(name, value, 0, UINT64_MAX, "uint64")


def to_int64(value: int) -> int:
    """uint64 ids (CANN) -> the int64 the native engine stores (two's complement, so
    2**64 - 1, CANN's "invalid id", becomes -1)."""
    return value - 2**64 if value > INT64_MAX else value


def is_valid_id(value: int) -> bool:
    """A req_id / prefix_id is valid when it is in [0, 2**64 - 1)."""
    return 0 <= value < INVALID_ID
