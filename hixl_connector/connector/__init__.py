"""The vLLM KV connector: what runs inside vLLM's processes.

- ``facade``: ``HixlConnector``, the class vLLM instantiates; it forwards to one half.
  ``vllm_interface`` holds what differs between the vLLM versions it supports.
- Shared by both halves: ``config`` (``kv_connector_extra_config``, validated), ``metadata``
  (the per-step metadata and ``kv_transfer_params``), ``link_reports`` (what workers tell
  the scheduler about links), ``stats``, ``limits``.
- ``scheduler/``: the scheduler half (EngineCore, pure bookkeeping; imports no torch, zmq,
  vLLM runtime, engine or ``datadist``).
- ``worker/``: the worker half (registration, D's reads, P's serving side); ``registered_kv``
  is the only module that configures the ``datadist`` back-end.
- ``leases/``: the lease server (P), client (D), their messages, and the lease words.
- ``mapping/``: pure planning of which blocks, heads and slices go where.
- ``peers/``: the side channel and its envelope, the handshake, the registry of links, and
  each rank's addresses.

The connector talks to transfer engines only through ``hixl_connector.datadist``.
``HixlConnector`` loads (and with it vLLM) on first access, so importing this package stays
as cheap as the modules it names.
"""

from typing import Any

__all__ = ["HixlConnector"]


def __getattr__(name: str) -> Any:
    if name == "HixlConnector":
        from hixl_connector.connector.facade import HixlConnector

        return HixlConnector
    raise AttributeError(f"module 'hixl_connector.connector' has no attribute {name!r}")
