"""A prefill-side peer for the ascend stand-in tests: a real process that serves one blocks
cache through the connector's "ascend" back-end on the llm_datadist STAND-IN.

Run: python standin_peer.py --cluster-id N --port P [--same-key-twice] [--misaligned]
    [--host-cache plain|pinned]
Prints {"pid"} once it serves BlocksCacheKey(N, 0) (Placement.DEVICE, played by host memory
at 2 MB-aligned bases, or not with --misaligned; tensor t, block b holds bytes equal to
(t * 31 + b) % 251). With --host-cache it also serves the same bytes from host memory under
model_id 2: plain (numpy) or from the stand-in's aclrtMallocHost. A stdin line "late" registers a
second cache under model_id 1 (after the test has linked) and answers "ok". EOF: finalize, exit.
With --same-key-twice it registers, straight on the stand-in (the back-end would refuse it), a
second cache under the same key whose bytes are one higher: the key then names that one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the stand-in first, then the checkout

NUM_TENSORS = 4
NUM_BLOCKS = 32
BLOCK_BYTES = 256
HOST_MODEL_ID = 2
ALIGNMENT_BYTES = 2 * 1024 * 1024


def aligned(values: np.ndarray, misaligned: bool = False) -> np.ndarray:
    """``values`` copied to a 2 MB-aligned base (or one 64 bytes past it)."""
    raw = np.zeros(values.nbytes + 2 * ALIGNMENT_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT_BYTES + (64 if misaligned else 0)
    out = raw[start : start + values.nbytes]
    out[:] = values
    return out


def block_value(tensor: int, block: int) -> int:
    return (tensor * 31 + block) % 251


def make_tensors(misaligned: bool = False) -> list[np.ndarray]:
    values = np.repeat(np.arange(NUM_BLOCKS), BLOCK_BYTES)
    return [
        aligned(((t * 31 + values) % 251).astype(np.uint8), misaligned) for t in range(NUM_TENSORS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--same-key-twice", action="store_true")
    parser.add_argument("--misaligned", action="store_true")
    parser.add_argument("--host-cache", choices=("plain", "pinned"))
    args = parser.parse_args()
    import llm_datadist

    from hixl_connector.datadist import load_backend

    api = llm_datadist if args.same_key_twice else load_backend("ascend")
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transfer_backend = "hixl"
    config.listen_ip_info = f"127.0.0.1:{args.port}"
    dd = api.LLMDataDist(api.LLMRole.PROMPT, args.cluster_id)
    dd.init(config.generate_options())
    desc = api.CacheDesc(
        NUM_TENSORS, [NUM_BLOCKS, BLOCK_BYTES], api.DataType.DT_UINT8, api.Placement.DEVICE
    )
    keep = make_tensors(args.misaligned)
    dd.cache_manager.register_blocks_cache(
        desc, [t.ctypes.data for t in keep], api.BlocksCacheKey(args.cluster_id, 0)
    )
    if args.host_cache:
        host = [
            llm_datadist.malloc_host(t.nbytes) if args.host_cache == "pinned" else t.copy()
            for t in make_tensors()
        ]
        for memory, values in zip(host, make_tensors(), strict=True):
            memory[:] = values
        keep += host
        host_desc = api.CacheDesc(
            NUM_TENSORS, [NUM_BLOCKS, BLOCK_BYTES], api.DataType.DT_UINT8, api.Placement.HOST
        )
        dd.cache_manager.register_blocks_cache(
            host_desc,
            [t.ctypes.data for t in host],
            api.BlocksCacheKey(args.cluster_id, HOST_MODEL_ID),
            remote_accessible=True,
        )
    if args.same_key_twice:
        newer = [aligned((t + 1).astype(np.uint8)) for t in make_tensors()]
        keep += newer
        dd.cache_manager.register_blocks_cache(
            desc, [t.ctypes.data for t in newer], api.BlocksCacheKey(args.cluster_id, 0)
        )
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "late":
            late = make_tensors()
            keep += late
            dd.cache_manager.register_blocks_cache(
                desc, [t.ctypes.data for t in late], api.BlocksCacheKey(args.cluster_id, 1)
            )
            print("ok", flush=True)
    dd.finalize()  # before the memory it serves is released
    del keep


if __name__ == "__main__":
    main()
