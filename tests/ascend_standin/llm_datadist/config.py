"""CANN's ``LlmConfig`` as its Python layer behaves: each option is a validating property, and
any other attribute (a misspelt option, or one of the native engine's ``hixl_*`` extensions)
is stored on the object and never turned into an option."""

from __future__ import annotations

from typing import Any

from hixl_connector.datadist import LLMConfig as _ProjectLLMConfig

# CANN always emits this option (LlmConfig._mem_utilization defaults to 0.95).
MEMORY_UTILIZATION_OPTION = "llm.MemoryUtilization"
DEFAULT_MEMORY_UTILIZATION = "0.95"


class _NotACannOption:
    """Hides a native-engine property: CANN's LlmConfig has no such attribute until a caller
    stores one, and then it is a plain attribute (a non-data descriptor lets that happen)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        raise AttributeError(f"'LlmConfig' object has no attribute {self._name!r}")


class LLMConfig(_ProjectLLMConfig):
    hixl_auth_token = _NotACannOption()
    hixl_transport = _NotACannOption()
    hixl_tcp_connections = _NotACannOption()
    hixl_transfer_threads = _NotACannOption()

    # No unknown-attribute check: CANN stores whatever it is given.
    __setattr__ = object.__setattr__

    def generate_options(self) -> dict[str, str]:
        options = super().generate_options()
        options[MEMORY_UTILIZATION_OPTION] = DEFAULT_MEMORY_UTILIZATION
        return options

    gen_options = generate_options


LlmConfig = LLMConfig
