"""Tools to run real vLLM prefill/decode disaggregation on one machine.

- ``tiny_model``: builds a small random Llama and tokenizer offline, deterministically.
- ``servers``: starts and stops vLLM OpenAI servers and the vLLM router as managed processes;
  ``processes``: one such child process, with its log, bounded waits and group shutdown.
- ``client``: minimal HTTP helpers for completions, chat, streaming and ``/metrics``.
- ``pd_demo`` (``python -m hixl_connector demo``): P, D and the router against a plain server;
  ``pd_workload`` sends its requests and reads D's metrics, ``pd_report`` prints the verdict.

Nothing here imports torch or vLLM at import time; only building the model does.
"""
