"""A prefill-side peer for the datadist conformance tests: a real process that registers host
caches through the LLM-DataDist v2 API and serves them until its stdin closes.

Run: python datadist_peer.py --cluster-id N [--backend native] [--auth-token T]
It prints one JSON line {"port", "pid", "caches": {name: cache_id}} once it is ready.

Caches (contents are ``tensor_bytes(seed, name, t, nbytes)`` so tests can recompute them):
- "kv":     blocks cache, BlocksCacheKey(cluster_id, 0), remote accessible;
- "hidden": blocks cache, BlocksCacheKey(cluster_id, 2), NOT remote accessible;
- "contig": contiguous cache of 2 rows under CacheKey(req_id=7) and CacheKey(req_id=8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NUM_LAYERS = 4
NUM_TENSORS = 2 * NUM_LAYERS  # K0, V0, K1, V1, ...
NUM_BLOCKS = 64
BLOCK_SHAPE = (4, 2, 32)  # tokens, kv heads, head dim (bf16)
BLOCK_BYTES = 4 * 2 * 32 * 2
CONTIG_ROWS = 2
CONTIG_ROW_BYTES = 8 * BLOCK_BYTES
CONTIG_REQ_IDS = (7, 8)
HIDDEN_MODEL_ID = 2
ALLOCATED_REQ_ID = 9  # the key of the peer's allocated cache, holding "contig" row 1
# Registered under another cluster's key: peers must not find it under this cluster's id.
FOREIGN_CLUSTER_OFFSET = 7
FOREIGN_MODEL_ID = 3
SEED = 1234


def tensor_bytes(seed: int, name: str, tensor: int, nbytes: int) -> np.ndarray:
    """The deterministic content of one tensor of a peer cache."""
    salt = sum(ord(c) for c in name) * 1000
    return np.random.default_rng(seed + salt + tensor).integers(0, 256, nbytes, dtype=np.uint8)


def make_tensors(name: str, count: int, nbytes: int, seed: int = SEED) -> list[np.ndarray]:
    return [tensor_bytes(seed, name, t, nbytes) for t in range(count)]


def _register(
    api: Any, dd: Any, cluster_id: int, with_allocated: bool = False
) -> tuple[dict[str, int], list[np.ndarray]]:
    cm = dd.cache_manager
    keep: list[np.ndarray] = []
    caches: dict[str, int] = {}
    host = api.Placement.HOST
    kv_desc = api.CacheDesc(NUM_TENSORS, [NUM_BLOCKS, *BLOCK_SHAPE], api.DataType.DT_BF16, host)
    entries = (
        ("kv", cluster_id, 0, True),
        ("hidden", cluster_id, HIDDEN_MODEL_ID, False),
        ("foreign", cluster_id + FOREIGN_CLUSTER_OFFSET, FOREIGN_MODEL_ID, True),
    )
    for name, key_cluster, model_id, accessible in entries:
        tensors = make_tensors(name, NUM_TENSORS, NUM_BLOCKS * BLOCK_BYTES)
        keep += tensors
        cache = cm.register_blocks_cache(
            kv_desc,
            [t.ctypes.data for t in tensors],
            api.BlocksCacheKey(key_cluster, model_id),
            remote_accessible=accessible,
        )
        caches[name] = cache.cache_id
    contig = make_tensors("contig", NUM_TENSORS, CONTIG_ROWS * CONTIG_ROW_BYTES)
    keep += contig
    desc = api.CacheDesc(NUM_TENSORS, [CONTIG_ROWS, CONTIG_ROW_BYTES], api.DataType.DT_UINT8, host)
    keys = [api.CacheKey(cluster_id, req_id) for req_id in CONTIG_REQ_IDS]
    contig_cache = cm.register_cache(
        desc, [t.ctypes.data for t in contig], keys, remote_accessible=True
    )
    caches["contig"] = contig_cache.cache_id
    if not with_allocated:
        return caches, keep
    # A cache from the engine's pool, under its own key, holding the contiguous cache's row 1.
    allocated = cm.allocate_cache(desc, [api.CacheKey(cluster_id, ALLOCATED_REQ_ID)])
    cm.copy_cache(allocated, contig_cache, 0, 1)
    caches["allocated"] = allocated.cache_id
    return caches, keep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster-id", type=int, required=True)
    parser.add_argument("--backend", default="native")
    parser.add_argument("--auth-token", default="")
    args = parser.parse_args()
    from hixl_connector.datadist import load_backend

    api = load_backend(args.backend)
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.transfer_backend = "hixl"
    config.listen_ip_info = "127.0.0.1:0"
    if args.backend == "native":  # CANN needs a device for its pools
        config.host_mem_pool_cfg = json.dumps({"memory_size": 1 << 20})
    if args.auth_token:
        config.hixl_auth_token = args.auth_token
    dd = api.LLMDataDist(api.LLMRole.PROMPT, args.cluster_id)
    dd.init(config.generate_options())
    caches, keep = _register(api, dd, args.cluster_id, with_allocated=args.backend == "native")
    print(json.dumps({"port": dd.listen_port, "pid": os.getpid(), "caches": caches}), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    dd.finalize()  # before the memory it serves is released
    del keep


if __name__ == "__main__":
    main()
