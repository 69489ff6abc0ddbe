"""hixl_connector: KV-cache transfer for disaggregated vLLM over the LLM-DataDist v2 API.

Importing this package is cheap and side-effect free: vLLM imports the connector class in
its API-server process too. `HixlConnector` (and with it vLLM) loads on first access.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["HixlConnector"]


def __getattr__(name: str) -> Any:
    if name == "HixlConnector":
        from hixl_connector.connector.facade import HixlConnector

        return HixlConnector
    raise AttributeError(f"module 'hixl_connector' has no attribute {name!r}")
