"""The scheduler half (EngineCore): pure request bookkeeping. Imports no torch, zmq,
vLLM runtime, engine or ``datadist``.
"""
