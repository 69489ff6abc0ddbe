"""The KV this worker registers with the engine: vLLM's tensors as the engine sees them
(layout), where vLLM's CPU kernels put each element of a block (probe), the word memory
beside them, and their registration (cache keys, grants, lease and push words).
"""
