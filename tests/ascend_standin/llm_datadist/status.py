"""CANN's ``LLMStatusCode`` and ``LLMException`` (reference section 5), and the checks its
Python layer raises with: rule checks raise ``LLM_PARAM_INVALID``, type checks ``TypeError``
(``None`` passes them), integer ranges ``ValueError``."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

_GE = (1 << 30) | (1 << 28) | (8 << 17) | (11 << 12)


class LLMStatusCode(IntEnum):
    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _GE | 0x01
    LLM_KV_CACHE_NOT_EXIST = _GE | 0x02
    LLM_REPEAT_REQUEST = _GE | 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _GE | 0x04
    LLM_PARAM_INVALID = _GE | 0x05
    LLM_ENGINE_FINALIZED = _GE | 0x06
    LLM_NOT_YET_LINK = _GE | 0x07
    LLM_ALREADY_LINK = _GE | 0x08
    LLM_LINK_FAILED = _GE | 0x09
    LLM_UNLINK_FAILED = _GE | 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _GE | 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _GE | 0x0C
    LLM_PROCESSING_LINK = _GE | 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _GE | 0x0E
    LLM_PREFIX_ALREADY_EXIST = _GE | 0x0F
    LLM_PREFIX_NOT_EXIST = _GE | 0x10
    LLM_SEQ_LENOVERLIMIT = _GE | 0x11
    LLM_NO_FREE_BLOCK = _GE | 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _GE | 0x13
    LLM_EXIST_LINK = _GE | 0x18
    LLM_FEATURE_NOT_ENABLED = _GE | 0x19
    LLM_TIMEOUT = _GE | 0x1A
    LLM_LINK_BUSY = _GE | 0x1B
    LLM_OUT_OF_MEMORY = _GE | 0x1C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:  # as CANN's enum prints on the Python versions it supports
        return f"LLMStatusCode.{self.name}"


class LLMException(RuntimeError):
    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


class Status:
    def __init__(self, status_code: LLMStatusCode) -> None:
        self._status_code = status_code

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


def status_of(code: int) -> LLMStatusCode:
    """A native code as CANN's enum; one the enum lacks is LLM_FAILED."""
    try:
        return LLMStatusCode(code)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


def handle_llm_status(code: int, func: str, detail: str) -> None:
    if code != 0:
        status = status_of(code)
        raise LLMException(f"{func} failed, error code is {status}, {detail}", status_code=status)


def raise_if_false(
    pred: object, message: str, status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID
) -> None:
    if not pred:
        raise LLMException(message, status_code=status_code)


def raise_if_true(
    pred: object, message: str, status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID
) -> None:
    raise_if_false(not pred, message, status_code)


def check_isinstance(name: str, value: Any, types: Any, element_type: Any = None) -> None:
    if value is None:
        return
    if not isinstance(value, types):
        raise TypeError(f"{name} type should be {types}, but got {type(value)}")
    if element_type is not None and any(not isinstance(v, element_type) for v in value):
        raise TypeError(f"{name} element type should be {element_type}")


def check_uint(name: str, value: Any, bits: int) -> None:
    check_isinstance(name, value, int)
    if value is not None and not 0 <= value < 1 << bits:
        raise ValueError(f"{name} should be in range [0, {(1 << bits) - 1}], but got {value}")
