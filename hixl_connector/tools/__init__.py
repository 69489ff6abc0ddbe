"""The project's tools, run as ``python -m hixl_connector <command>``: the P/D demo with real
vLLM (``demo``), the transfer benchmarks (``bench``, ``bench_tp``, ``bench_report``), the soak
(``soak``) and the fault-matrix report (``reliability``). Tools may import anything; the
connector and the datadist API never import tools.
"""
