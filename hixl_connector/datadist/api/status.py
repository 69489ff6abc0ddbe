"""LLMStatusCode, LLMException and the status helpers of the LLM-DataDist v2 API.

Numeric values are those of CANN ``llm_datadist`` (GE error numbers ``0x5010B000 + n``), so a
status code logged on one backend means the same thing on the other.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NoReturn

_GE_BASE = (1 << 30) | (1 << 28) | (8 << 17) | (11 << 12)


class LLMStatusCode(IntEnum):
    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _GE_BASE + 0x01
    LLM_KV_CACHE_NOT_EXIST = _GE_BASE + 0x02
    LLM_REPEAT_REQUEST = _GE_BASE + 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _GE_BASE + 0x04
    LLM_PARAM_INVALID = _GE_BASE + 0x05
    LLM_ENGINE_FINALIZED = _GE_BASE + 0x06
    LLM_NOT_YET_LINK = _GE_BASE + 0x07
    LLM_ALREADY_LINK = _GE_BASE + 0x08
    LLM_LINK_FAILED = _GE_BASE + 0x09
    LLM_UNLINK_FAILED = _GE_BASE + 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _GE_BASE + 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _GE_BASE + 0x0C
    LLM_PROCESSING_LINK = _GE_BASE + 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _GE_BASE + 0x0E
    LLM_PREFIX_ALREADY_EXIST = _GE_BASE + 0x0F
    LLM_PREFIX_NOT_EXIST = _GE_BASE + 0x10
    LLM_SEQ_LENOVERLIMIT = _GE_BASE + 0x11
    LLM_NO_FREE_BLOCK = _GE_BASE + 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _GE_BASE + 0x13
    LLM_EXIST_LINK = _GE_BASE + 0x18
    LLM_FEATURE_NOT_ENABLED = _GE_BASE + 0x19
    LLM_TIMEOUT = _GE_BASE + 0x1A
    LLM_LINK_BUSY = _GE_BASE + 0x1B
    LLM_OUT_OF_MEMORY = _GE_BASE + 0x1C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


class LLMException(RuntimeError):
    """Raised by the API; ``status_code`` says why (``LLM_SUCCESS`` when unset, as in CANN)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


class Status:
    def __init__(self, status: LLMStatusCode) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


_KNOWN_CODES = {
    int(code): code for code in LLMStatusCode if code != LLMStatusCode.LLM_UNKNOWN_ERROR
}


def code_to_status(code: int) -> LLMStatusCode:
    """Any code the enum lacks surfaces as LLM_FAILED, as in CANN."""
    return _KNOWN_CODES.get(int(code), LLMStatusCode.LLM_FAILED)


def raise_status(code: int, func_name: str, detail: str) -> NoReturn:
    status = code_to_status(code)
    raise LLMException(f"{func_name} failed, error code is {status}, {detail}.", status_code=status)


def check_status(code: int, func_name: str, detail: str) -> None:
    if code != 0:
        raise_status(code, func_name, detail)


def raise_if_false(
    pred: object,
    message: str,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
) -> None:
    if not pred:
        raise LLMException(message, status_code=status_code)


def raise_if_true(
    pred: object,
    message: str,
    status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
) -> None:
    if pred:
        raise LLMException(message, status_code=status_code)
