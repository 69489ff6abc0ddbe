"""The vLLM KV connector: what runs inside vLLM's processes.

- ``facade``: ``HixlConnector``, the class vLLM instantiates; it forwards to one half.
- Scheduler half (EngineCore, pure bookkeeping; imports no torch, zmq or vLLM):
  ``scheduler``, ``metadata`` (its per-step metadata and ``kv_transfer_params``),
  ``config``, ``rank_addresses`` (each rank's ports and cluster id), ``limits``, ``blocks``,
  ``block_slices``, ``lease_words``.
- Worker half (every worker): ``worker`` (registration, per-step hooks),
  ``receiver`` (D's reads), ``read_plans`` (what it reads of each P shape), ``peers``
  (handshake and link per P rank), ``handshake`` (the payload and the compatibility
  check), ``engine_setup`` (the only module that configures
  the datadist back-end), ``kv_layout`` / ``kv_probe`` / ``tp_mapping`` (what bytes go
  where), the lease protocol (``lease_server`` on P, ``lease_client`` on D,
  ``lease_messages`` between them, over ``side_channel``), ``stats``.

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
