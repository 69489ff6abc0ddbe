"""The project's tools, run as ``python -m hixl_connector <command>``.

- ``demo/``: P/D with real vLLM servers and vllm-router against a plain server (``demo``);
- ``bench``, ``bench_report``: the transfer benchmark between two processes, its table and
  plot; ``bench_tp``: TP-mismatched pulls against equal-TP pulls of the same bytes;
- ``bench_serve``: vLLM's own load generator, plain server against P/D (``bench-serve``);
- ``soak``: many requests through router, P and D; ``reliability``: the fault-matrix table.

Tools may import anything; the connector and the datadist API never import tools.
"""
