"""hixl_connector: KV-cache transfer for disaggregated vLLM over the LLM-DataDist v2 API.

Three layers, each importing only those below it:

- ``connector/``: the vLLM KV connector (``HixlConnector``) and everything it runs;
- ``datadist/``: the LLM-DataDist v2 API, the connector's one seam to transfer engines,
  with the native back-end (``_native``, built from ``native/``) and the ascend one (CANN);
- ``tools/``: the demo, benchmarks, soak and reports, run as ``python -m hixl_connector``.

Beside them: ``plugin`` (vLLM's entry point, registering "HixlConnector" by name) and
``__main__`` (the tools' command dispatcher).

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
