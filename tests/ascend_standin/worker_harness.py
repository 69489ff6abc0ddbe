"""Builds a real HixlWorker the way vLLM would on Ascend, with torch CPU tensors standing in
for the NPU KV tensors: a VllmConfig of the tiny test model, a one-rank TP group (gloo), and
KV caches in vllm-ascend's form, one ``(k_cache, v_cache)`` tuple per attention layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hixl_connector.connector.kv.word_memory import aligned_zeros
from hixl_connector.tools.vllm_scheduler import BLOCK_SIZE

NUM_LAYERS = 2
NUM_BLOCKS = 64
KV_HEADS = 2  # the tiny model's
HEAD_SIZE = 16
# The stand-in P's start nonce: its prefill_worker plays P's scheduler and writes it.
P_INCARNATION = 0x5EED


@contextmanager
def tp_group(config: Any, port: int) -> Iterator[None]:
    """A real one-rank tensor-parallel group, as every vLLM worker has."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def kv_caches(fill: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """K and V per layer, [num_blocks, block_size, kv_heads, head_size]; with ``fill``, element
    values encode (tensor, block) so a test can recompute any block's content."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    caches = {}
    for layer in range(NUM_LAYERS):
        parts = []
        for part in range(2):
            # HCCS reads device memory from 2 MB-aligned bases only; vllm-ascend allocates so.
            tensor = aligned_zeros(
                NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_SIZE, torch.float32, "cpu"
            )
            tensor = tensor.view(shape)
            if fill:
                tensor += expected_block(2 * layer + part, torch.arange(NUM_BLOCKS)).view(
                    NUM_BLOCKS, 1, 1, 1
                )
            parts.append(tensor)
        caches[f"model.layers.{layer}.self_attn.attn"] = (parts[0], parts[1])
    return caches


def expected_block(tensor: int, block: Any) -> Any:
    """The value every element of block ``block`` of KV tensor ``tensor`` holds on P."""
    return 1000.0 * (tensor + 1) + block


def decode_worker(config: Any, engine_id: str) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """A real HixlWorker of ``config`` (inside its TP group) with empty KV caches registered:
    (the worker, its caches)."""
    from hixl_connector.connector.config import HixlConfig
    from hixl_connector.connector.worker.half import HixlWorker

    worker = HixlWorker(config, HixlConfig.from_vllm_config(config), engine_id)
    caches = kv_caches(fill=False)
    worker.register_kv_caches(dict(caches))
    return worker, caches
