"""Times HixlConnector's hooks inside a vLLM server (``bench-serve --time-hooks``): this
folder first on the server's PYTHONPATH loads ``sitecustomize``, which wraps the hooks once
the connector's facade is imported (tools/hook_times.py reads what it writes)."""
