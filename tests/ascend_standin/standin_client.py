"""Shared by the stand-in tests: a decode-side LLMDataDist on an API (the raw stand-in module,
or the "ascend" back-end over it), its blocks caches, its links, status-code asserts, and a
prefill-side peer process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import start, stop
from standin_peer import BLOCK_BYTES, NUM_BLOCKS, NUM_TENSORS, aligned

from hixl_connector.tools.demo.processes import free_port


def init_client(api: Any, cluster_id: int, listen: str = "127.0.0.1:0", pool: int = 0) -> Any:
    """A decoder LLMDataDist as the connector configures one; ``pool``: bytes of the device
    memory pool (mem_pool_cfg), 0 for none."""
    config = api.LLMConfig()
    if pool:
        config.mem_pool_cfg = json.dumps({"memory_size": pool})
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transfer_backend = "hixl"
    config.listen_ip_info = listen
    config.sync_kv_timeout = 5000
    dd = api.LLMDataDist(api.LLMRole.DECODER, cluster_id)
    dd.init(config.generate_options())
    return dd


def register(
    api: Any,
    dd: Any,
    cluster_id: int,
    model_id: int,
    accessible: bool | None = True,
    memory: str = "device",
) -> tuple[Any, list[np.ndarray]]:
    """A blocks cache of zeroes under (cluster_id, model_id): ``memory`` "device" (2 MB
    aligned), "host" (plain host memory) or "pinned" (the stand-in's aclrtMallocHost)."""
    size = NUM_BLOCKS * BLOCK_BYTES
    tensors = [
        aligned(np.zeros(size, np.uint8))
        if memory == "device"
        else api.malloc_host(size)
        if memory == "pinned"
        else np.zeros(size, np.uint8)
        for _ in range(NUM_TENSORS)
    ]
    placement = api.Placement.DEVICE if memory == "device" else api.Placement.HOST
    desc = api.CacheDesc(NUM_TENSORS, [NUM_BLOCKS, BLOCK_BYTES], api.DataType.DT_UINT8, placement)
    cache = dd.cache_manager.register_blocks_cache(
        desc,
        [t.ctypes.data for t in tensors],
        api.BlocksCacheKey(cluster_id, model_id),
        remote_accessible=accessible,
    )
    return cache, tensors


def link(api: Any, dd: Any, peer_cluster: int, port: int) -> None:
    info = api.LLMClusterInfo()
    info.remote_cluster_id = peer_cluster
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    status, per_cluster = dd.link_clusters([info], 5000)
    assert status == api.LLMStatusCode.LLM_SUCCESS, (status, per_cluster)


def raises(api: Any, code: str, action: Callable[[], Any], match: str | None = None) -> None:
    with pytest.raises(api.LLMException, match=match) as info:
        action()
    assert info.value.status_code == getattr(api.LLMStatusCode, code), info.value


def first_bytes(tensor: np.ndarray, blocks: list[int]) -> list[int]:
    rows = tensor.reshape(NUM_BLOCKS, BLOCK_BYTES)
    return [int(rows[b][0]) for b in blocks]


@contextmanager
def running_peer(cluster_id: int, *flags: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A standin_peer.py process serving BlocksCacheKey(cluster_id, 0); stopped on exit."""
    port = free_port()
    script = str(Path(__file__).resolve().parent / "standin_peer.py")
    proc, _ = start(
        [sys.executable, script, "--cluster-id", str(cluster_id), "--port", str(port), *flags]
    )
    try:
        yield proc, port
    finally:
        stop(proc)
