"""vLLM general-plugin entry point: makes `"kv_connector": "HixlConnector"` work by name.

vLLM loads `vllm.general_plugins` entry points in every process it starts, so registering
here lets users drop `kv_connector_module_path`. Registration is lazy (module and class
names only), keeping this import as cheap as the package itself.
"""

from __future__ import annotations

CONNECTOR_NAME = "HixlConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return  # vLLM may load plugins more than once per process
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "hixl_connector.connector", CONNECTOR_NAME
    )
