"""What the transfer benchmarks (bench, bench-tp) share: the model's KV shape, pools of one
memory kind, the engine options of both sides, linking, the handle of a serving process, and
the paired ratio."""

from __future__ import annotations

import json
import mmap
import select
import statistics
import subprocess
from typing import Any

import numpy as np

# An 8B-class model's KV: 32 layers of 8 KV heads of 128 dims in 16-bit.
LAYERS = 32
NUM_TENSORS = 2 * LAYERS  # K and V of each layer, one tensor each
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2
READY_TIMEOUT_S = 120.0
LINK_TIMEOUT_MS = 10000
HUGE_PAGE = 2 << 20


def datadist_api() -> Any:
    from hixl_connector import datadist

    return datadist


def alloc_tensors(nbytes: int, fills: list[int]) -> list[np.ndarray]:
    """One tensor of ``nbytes`` per fill byte, each starting on a 2 MiB boundary of one
    anonymous mapping advised MADV_HUGEPAGE, so every pool (server source, client destination
    and the memcpy reference's source) is the same kind of memory whatever numpy's own policy
    is."""
    stride = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    size = len(fills) * stride + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(region, np.uint8)
    first = -whole.ctypes.data % HUGE_PAGE
    # Filled pages: an untouched pool would be served from the shared zero page.
    tensors = [whole[first + t * stride :][:nbytes] for t in range(len(fills))]
    for tensor, fill in zip(tensors, fills, strict=True):
        tensor.fill(fill)
    return tensors


def engine_options(
    transport: str | None, threads: int, listen: str | None, connections: int | None = None
) -> dict[str, str]:
    """Options of a benchmark engine: one that serves with ``listen``, else one that pulls."""
    config = datadist_api().LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.sync_kv_timeout = 60000
    config.hixl_transfer_threads = threads
    if listen:
        config.transfer_backend = "hixl"
        config.listen_ip_info = listen
    if transport:
        config.hixl_transport = transport
    if connections is not None:  # else one per transfer thread, the engine's default
        config.hixl_tcp_connections = connections
    return config.generate_options()


def link(dd: Any, cluster: int, port: int) -> Any:
    """Links ``dd`` to the serving engine ``cluster`` on 127.0.0.1:``port``; returns the
    cluster info to unlink it with."""
    api = datadist_api()
    info = api.LLMClusterInfo()
    info.remote_cluster_id = cluster
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    ret, rets = dd.link_clusters([info], LINK_TIMEOUT_MS)
    if ret != api.LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link to cluster {cluster} on port {port} failed: {ret} {rets}")
    return info


class Server:
    """A serving process started with ``cmd``: it prints one JSON line once ready (port, pid,
    bases) and its engine's stats when its stdin closes."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError("benchmark server did not start")
        ready = json.loads(line)
        self.port, self.pid, self.bases = int(ready["port"]), int(ready["pid"]), ready["bases"]

    def stop(self) -> dict[str, int]:
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return {}
        lines = out.strip().splitlines()
        return dict(json.loads(lines[-1])) if lines else {}


def median_ratio(reference: list[float], measured: list[float]) -> float:
    """Median of per-iteration reference/measured time ratios (speed of measured relative to
    reference): robust to load that changes during the run."""
    return statistics.median(r / m for r, m in zip(reference, measured, strict=True))
