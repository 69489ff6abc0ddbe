"""The vLLM KV connector: what runs inside vLLM's processes.

Its rooms, from the bottom up (an import only ever points down; tests/unit/test_import_rules.py
holds the order):

- ``limits``, ``endpoints`` (the engine identity: a prefill engine, its ranks, their
  addresses), ``transfer_params`` (what P tells D through the router).
- ``mapping/``: pure planning of which blocks, heads and slices go where.
- ``metadata`` (the per-step metadata), ``link_reports`` (what workers tell the scheduler
  about links), ``config`` (``kv_connector_extra_config``, validated), ``stats``,
  ``outcomes`` (where D's receivers report what ended, for the step thread),
  ``vllm_interface`` (what differs between the vLLM versions it supports).
- ``peers/``: the side channel and its envelope, the handshake, the registry of links.
- ``leases/``: the lease server (P), client (D), their messages, and the guarded read.
- ``kv/``: the KV registered with the engine, its layout and words; ``registered_kv`` is the
  only module that configures the ``datadist`` back-end.
- ``push/``: both halves of push mode and its guarded write.
- ``scheduler/``: the scheduler half (EngineCore, pure bookkeeping; imports no torch, zmq,
  vLLM runtime, engine or ``datadist``).
- ``worker/``: the worker half, a composition root of D's role and P's role.
- ``facade``: ``HixlConnector``, the class vLLM instantiates; it forwards to one half.

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
