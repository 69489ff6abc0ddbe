"""Builds a real HixlWorker the way vLLM would on Ascend, with torch CPU tensors standing in
for the NPU KV tensors: a VllmConfig of the tiny test model, a one-rank TP group (gloo), and
KV caches in vllm-ascend's form, one ``(k_cache, v_cache)`` tuple per attention layer; for a
hybrid state model also a ``[conv, ssm]`` list per state layer, in vllm-ascend's planes.
"""

from __future__ import annotations

import math
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


# A hybrid state model as vllm-ascend (0.16 and later) lays it out: each layer slot one
# 2 MB-aligned buffer of NUM_BLOCKS pages, cut in planes: every block's conv state, every
# block's ssm state (the same bytes as the attention layer's K: a K block is as large as an
# ssm state), then V.
STATE_CONV, STATE_SSM = (3, 64), (4, 16, 8)  # fp32: 768 bytes; 2048, a K block
STATE_GROUP = 1


def attention_layer(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def state_layer(layer: int) -> str:
    return f"model.layers.{layer}.linear_attn"


def hybrid_kv_cache_config() -> Any:
    """The KV-cache config of a layer of attention and a state layer in each layer slot."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from hixl_connector.tools.vllm_scheduler import MAX_MODEL_LEN

    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    mamba = MambaSpec(
        block_size=MAX_MODEL_LEN,
        shapes=(STATE_CONV, STATE_SSM),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="none",
    )
    layers = range(NUM_LAYERS)
    groups = [
        KVCacheGroupSpec([attention_layer(i) for i in layers], attention),
        KVCacheGroupSpec([state_layer(i) for i in layers], mamba),
    ]
    return KVCacheConfig(NUM_BLOCKS, [], groups)


def hybrid_kv_caches(fill: bool) -> dict[str, Any]:
    """kv_caches in vllm-ascend's planes; with ``fill``, K and V as ``kv_caches`` fills them
    (so an ssm state holds its K block's values) and conv states ``expected_conv``."""
    n, conv, ssm = NUM_BLOCKS, math.prod(STATE_CONV), math.prod(STATE_SSM)
    kv_shape = (n, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    caches: dict[str, Any] = {}
    blocks = torch.arange(n).view(n, 1, 1, 1)
    for layer in range(NUM_LAYERS):
        raw = aligned_zeros(n * (conv + 2 * ssm), torch.float32, "cpu")
        conv_plane = raw[: n * conv].view(n, *STATE_CONV)
        k = raw[n * conv : n * (conv + ssm)].view(kv_shape)
        v = raw[n * (conv + ssm) :].view(kv_shape)
        if fill:
            k += expected_block(2 * layer, blocks)
            v += expected_block(2 * layer + 1, blocks)
            conv_plane += expected_conv(layer, blocks.view(n, 1, 1))
        caches[attention_layer(layer)] = (k, v)
        caches[state_layer(layer)] = [conv_plane, k.view(n, *STATE_SSM)]
    return caches


def expected_conv(layer: int, block: Any) -> Any:
    """The value every element of block ``block``'s conv state of state layer ``layer`` holds
    on P."""
    return 1000.0 * (100 + layer) + block


def expected_block(tensor: int, block: Any) -> Any:
    """The value every element of block ``block`` of KV tensor ``tensor`` holds on P."""
    return 1000.0 * (tensor + 1) + block


@contextmanager
def decode_engine(
    model_dir: Any, engine_id: str, extra: dict[str, Any], state: bool = False
) -> Iterator[tuple[Any, dict[str, Any], Any]]:
    """A real HixlWorker as D (kv_consumer) of ``model_dir`` with the connector's ``extra``
    config, over the stand-in, inside its TP group, with empty KV caches registered (a hybrid
    state model's with ``state``): (the worker, its caches, the stand-in)."""
    from harness import standin_on_path

    from hixl_connector.tools.demo.processes import free_port
    from hixl_connector.tools.vllm_scheduler import vllm_config

    mode = "none" if state else ""
    config = vllm_config(model_dir, "kv_consumer", engine_id=engine_id, extra=extra, state=mode)
    with standin_on_path() as standin, tp_group(config, free_port()):
        worker, caches = worker_with_caches(config, engine_id, state, fill=False)
        yield worker, caches, standin


def received(worker: Any, spec: Any, timeout_s: float) -> bool:
    """Hands read ``spec`` to D's ``worker`` as a step of vLLM's would, then asks for results
    until it has one (bounded): whether it was received rather than failed."""
    import time

    from hixl_connector.connector.metadata import HixlConnectorMetadata

    worker.start_load_kv(HixlConnectorMetadata(to_recv=[spec]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = worker.get_transfer_results()
        if spec.request_id in results.finished_recving:
            return spec.request_id not in results.failed_recving
        time.sleep(0.02)
    raise AssertionError(f"no result for {spec.request_id} within {timeout_s}s")


def decode_engine_extra(cluster_id_base: int, timeout_s: float) -> dict[str, Any]:
    """The connector's config of a stand-in D on the "ascend" back-end (whose engine listens
    on D too), reads and handshakes bounded by ``timeout_s``."""
    from hixl_connector.tools.demo.processes import free_port

    return {
        "backend": "ascend",
        "cluster_id_base": cluster_id_base,
        "engine_port": free_port(),
        "pull_timeout_s": timeout_s,
        "handshake_timeout_s": 2 * timeout_s,
    }


def decode_worker(config: Any, engine_id: str) -> tuple[Any, dict[str, Any]]:
    """A real HixlWorker of ``config`` (inside its TP group) with empty KV caches registered:
    (the worker, its caches)."""
    return worker_with_caches(config, engine_id, state=False, fill=False)


def worker_with_caches(
    config: Any, engine_id: str, state: bool, fill: bool
) -> tuple[Any, dict[str, Any]]:
    """A real HixlWorker of ``config`` with its KV caches registered (filled with ``fill``),
    a hybrid state model's with ``state``: (the worker, its caches)."""
    from hixl_connector.connector.config import HixlConfig
    from hixl_connector.connector.worker.half import HixlWorker

    groups = hybrid_kv_cache_config() if state else None
    worker = HixlWorker(config, HixlConfig.from_vllm_config(config), engine_id, groups)
    caches: dict[str, Any] = hybrid_kv_caches(fill) if state else dict(kv_caches(fill))
    worker.register_kv_caches(dict(caches))
    return worker, caches
