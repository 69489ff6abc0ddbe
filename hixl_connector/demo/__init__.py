"""Tools to run real vLLM prefill/decode disaggregation on one machine.

- ``tiny_model``: builds a small random Llama and tokenizer offline, deterministically.
- ``servers``: starts and stops vLLM OpenAI servers and the vLLM router as managed processes.
- ``client``: minimal HTTP helpers for completions, chat, streaming and ``/metrics``.

Nothing here imports torch or vLLM at import time; only building the model does.
"""
