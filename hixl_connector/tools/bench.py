"""Benchmark of ``pull_blocks`` (and ``push_blocks``) between two processes on the native
engine.

Layout: Llama-8B KV cache (32 layers, K and V as separate tensors = 64 tensors, 8 KV heads,
head_dim 128, bf16), blocks of 16 and 128 tokens, a 1 GiB pool per side. Measured per transport:
a 2048-token request with fresh random block ids each iteration, 1-block and 8-block latency,
and the planning time of 128 blocks x 64 tensors. Each request is paired with an in-process
scatter memcpy of a request of the same shape (same chunking, same thread count), run back to
back in rotating order; "ratio" is the median of the per-pair ratios, so load from other
processes that changes during the run affects both sides of a pair alike. Each pull is also
paired with a bare reference of its transport moving the same shape: for cma, bare
process_vm_readv calls reading from the server process on the same schedule (the kernel's
ceiling for one-sided reads); for tcp, bare loopback sockets, as many connections as the
engine's, one sending and one receiving thread each, no requests and no framing ("bare
ratio" is the reference's ratio to memcpy, "of bare" the engine's ratio to it). Every pool
(server source, client destination, the memcpy's source) is the same kind of memory:
anonymous, advised MADV_HUGEPAGE, tensors 2 MiB aligned.

    python -m hixl_connector bench [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl_connector.datadist.api.config import MAX_TCP_CONNECTIONS
from hixl_connector.tools.bench_common import (
    DTYPE_BYTES,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    NUM_TENSORS,
    Server,
    alloc_tensors,
    datadist_api,
    engine_options,
    link,
    median_ratio,
)
from hixl_connector.tools.bench_report import format_table, plot

SERVER_CLUSTER, CLIENT_CLUSTER = 1, 2


@dataclass(frozen=True)
class Layout:
    block_tokens: int
    pool_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * KV_HEADS * HEAD_DIM * DTYPE_BYTES

    @property
    def num_blocks(self) -> int:
        return self.pool_bytes // (NUM_TENSORS * self.block_bytes)


def _alloc_pool(layout: Layout, fill: bool) -> list[np.ndarray]:
    fills = [(t + 1) & 0xFF if fill else 0 for t in range(NUM_TENSORS)]
    return alloc_tensors(layout.num_blocks * layout.block_bytes, fills)


def _register(dd: Any, layout: Layout, tensors: list[np.ndarray], key: Any) -> Any:
    api = datadist_api()
    desc = api.CacheDesc(
        NUM_TENSORS,
        [layout.num_blocks, layout.block_tokens, KV_HEADS, HEAD_DIM],
        api.DataType.DT_BF16,
        api.Placement.HOST,
    )
    return dd.cache_manager.register_blocks_cache(
        desc, [t.ctypes.data for t in tensors], key, remote_accessible=True
    )


def serve(layout: Layout, threads: int) -> None:
    """The prefill side: serve one pool until stdin closes, then print the engine's stats."""
    api = datadist_api()
    dd = api.LLMDataDist(api.LLMRole.PROMPT, SERVER_CLUSTER)
    dd.init(engine_options(None, threads, "127.0.0.1:0"))
    tensors = _alloc_pool(layout, fill=True)
    _register(dd, layout, tensors, api.BlocksCacheKey(SERVER_CLUSTER, 0))
    ready = {"port": dd.listen_port, "pid": os.getpid(), "bases": _bases(tensors)}
    print(json.dumps(ready), flush=True)
    sys.stdin.read()
    print(json.dumps(dd.engine_stats()), flush=True)
    dd.finalize()


def serve_command(layout: Layout, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "hixl_connector.tools.bench", "--serve"]
    cmd += ["--block-tokens", str(layout.block_tokens), "--pool-bytes", str(layout.pool_bytes)]
    return cmd + ["--threads", str(threads)]


def _random_pairs(
    rng: np.random.Generator, num_blocks: int, count: int
) -> tuple[list[int], list[int]]:
    src = rng.choice(num_blocks, count, replace=False).tolist()
    dst = rng.choice(num_blocks, count, replace=False).tolist()
    return src, dst


def _ops(
    refs: Any,
    src: list[int],
    dst: list[int],
    src_bases: list[int],
    dst_bases: list[int],
    block_bytes: int,
) -> tuple[list[int], list[int], list[int]]:
    """The engine's plan as (dst, src, length) lists: one op per tensor per run."""
    dst_addrs, src_addrs, lengths = [], [], []
    for src_start, dst_start, length in refs.plan_runs(src, dst):
        for t in range(NUM_TENSORS):
            dst_addrs.append(dst_bases[t] + dst_start * block_bytes)
            src_addrs.append(src_bases[t] + src_start * block_bytes)
            lengths.append(length * block_bytes)
    return dst_addrs, src_addrs, lengths


def _bases(tensors: list[np.ndarray]) -> list[int]:
    return [int(t.ctypes.data) for t in tensors]


class Measurement:
    """Pulls of a linked client, each paired with an in-process scatter memcpy of a request of
    the same shape between pools of the same memory kind and with the transport's bare
    reference, run back to back in rotating order so that all of them see the same load on a
    shared machine."""

    def __init__(
        self,
        refs: Any,
        dd: Any,
        layout: Layout,
        threads: int,
        server: Server,
        transport: str,
        connections: int,
    ) -> None:
        self.refs, self.dd, self.layout, self.threads = refs, dd, layout, threads
        self.server, self.transport, self.connections = server, transport, connections
        self.key = datadist_api().BlocksCacheKey(SERVER_CLUSTER, 0)
        self.pool = _alloc_pool(layout, fill=False)
        self.cache = _register(dd, layout, self.pool, None)
        # The same bytes as the server's pool, so a copy from it is the pull's physical limit,
        # and a push from it leaves the server's bytes as they were.
        self.replica = _alloc_pool(layout, fill=True)
        self.replica_cache = _register(dd, layout, self.replica, None)
        self.pool_bases, self.replica_bases = _bases(self.pool), _bases(self.replica)
        self.rng = np.random.default_rng(11)

    def pull(self, count: int) -> float:
        src, dst = _random_pairs(self.rng, self.layout.num_blocks, count)
        probe = self.pool[NUM_TENSORS - 1]
        offset = dst[0] * self.layout.block_bytes
        probe[offset] = 0  # a stale copy of the same bytes must not pass the check below
        start = time.perf_counter()
        self.dd.cache_manager.pull_blocks(self.key, self.cache, src, dst)
        elapsed = time.perf_counter() - start
        if int(probe[offset]) != NUM_TENSORS & 0xFF:
            raise RuntimeError("pulled bytes do not match the server's pool")
        return elapsed

    def push(self, count: int) -> float:
        src, dst = _random_pairs(self.rng, self.layout.num_blocks, count)
        start = time.perf_counter()
        self.dd.cache_manager.push_blocks(self.key, self.replica_cache, src, dst)
        return time.perf_counter() - start

    def copy(self, count: int) -> float:
        src, dst = _random_pairs(self.rng, self.layout.num_blocks, count)
        ops = _ops(
            self.refs, src, dst, self.replica_bases, self.pool_bases, self.layout.block_bytes
        )
        return float(self.refs.scatter_copy(*ops, self.threads))

    def bare(self, count: int) -> float:
        """The transport's bare reference: process_vm_readv from the server's pool (cma), or
        the same bytes over bare loopback sockets of this process (tcp)."""
        src, dst = _random_pairs(self.rng, self.layout.num_blocks, count)
        if self.transport == "cma":
            bases = self.server.bases
            ops = _ops(self.refs, src, dst, bases, self.pool_bases, self.layout.block_bytes)
            elapsed = float(self.refs.scatter_read_process(self.server.pid, *ops, self.threads))
        else:
            bases = self.replica_bases
            ops = _ops(self.refs, src, dst, bases, self.pool_bases, self.layout.block_bytes)
            elapsed = float(self.refs.tcp_stream(*ops, self.connections))
        if elapsed < 0:
            raise RuntimeError(f"the bare {self.transport} reference failed")
        return elapsed

    def interleaved(self, count: int, iters: int) -> dict[str, list[float]]:
        """Times per kind ("pull", "push", "copy", "bare"), one of each per iteration, in an
        order that rotates so that no kind always runs first."""
        runs = {"pull": self.pull, "push": self.push, "copy": self.copy, "bare": self.bare}
        for run in runs.values():
            run(count)  # warm-up: first touch of pages and of the engine's paths
        kinds = list(runs)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for i in range(iters):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                times[kind].append(runs[kind](count))
        return times


def measure_transport(
    refs: Any,
    transport: str,
    layout: Layout,
    server: Server,
    tokens: int,
    iters: int,
    lat_iters: int,
    threads: int,
    connections: int | None = None,
) -> dict[str, Any]:
    api = datadist_api()
    dd = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER)
    dd.init(engine_options(transport, threads, None, connections))
    try:
        # As many bare connections as the engine opens: one per thread unless set.
        bare_connections = connections or min(threads, MAX_TCP_CONNECTIONS)
        m = Measurement(refs, dd, layout, threads, server, transport, bare_connections)
        info = link(dd, SERVER_CLUSTER, server.port)
        count = tokens // layout.block_tokens
        times = m.interleaved(count, iters)
        pulls, copies = times["pull"], times["copy"]
        one = [m.pull(1) for _ in range(lat_iters)]
        eight = [m.pull(8) for _ in range(lat_iters)]
        request_bytes = NUM_TENSORS * count * layout.block_bytes
        stats = dd.engine_stats()
        result = {
            "transport_used": dd.peer_transport(SERVER_CLUSTER),
            "request_gbps": request_bytes / statistics.median(pulls) / 1e9,
            "request_ms_p50": statistics.median(pulls) * 1e3,
            "memcpy_gbps": request_bytes / statistics.median(copies) / 1e9,
            # Median of per-pair ratios: robust to load that changes during the run.
            "ratio_to_memcpy": median_ratio(copies, pulls),
            "one_block_us_p50": statistics.median(one) * 1e6,
            "eight_blocks_us_p50": statistics.median(eight) * 1e6,
            "client_peak_internal_bytes": int(stats.get("peak_internal_bytes", 0)),
        }
        pushes = times["push"]
        result["push_gbps"] = request_bytes / statistics.median(pushes) / 1e9
        result["push_ratio_to_memcpy"] = median_ratio(copies, pushes)
        result["push_one_block_us_p50"] = (
            statistics.median(m.push(1) for _ in range(lat_iters)) * 1e6
        )
        bares = times["bare"]
        result["bare_gbps"] = request_bytes / statistics.median(bares) / 1e9
        result["bare_ratio_to_memcpy"] = median_ratio(copies, bares)
        result["ratio_to_bare"] = median_ratio(bares, pulls)
        dd.unlink_clusters([info], 5000)
        return result
    finally:
        dd.finalize()


def load_references() -> Any:
    """The benchmark references (planner timing, scatter memcpy, bare process_vm_readv), a
    module of their own that the connector never loads."""
    try:
        from hixl_connector import _native_bench
    except ImportError as exc:
        raise ImportError(
            "the benchmark module hixl_connector._native_bench is not built; install the "
            "package with HIXL_TOOLS=1 set (bash .ci/setup does; a C++17 compiler, CMake and "
            "the OpenSSL headers are needed)"
        ) from exc
    return _native_bench


def run(args: argparse.Namespace) -> dict[str, Any]:
    refs = load_references()

    tokens = 512 if args.quick else 2048
    pool_bytes = (256 << 20) if args.quick else (1 << 30)
    iters, lat_iters = (2, 5) if args.quick else (15, 50)
    plan_blocks = np.random.default_rng(3).permutation(4096)[:256].tolist()
    plan_s = refs.time_plan(
        plan_blocks[:128], plan_blocks[128:], NUM_TENSORS, 200 if args.quick else 2000
    )
    report: dict[str, Any] = {
        "config": dict(
            layers=LAYERS,
            tensors=NUM_TENSORS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            dtype_bytes=DTYPE_BYTES,
            pool_bytes=pool_bytes,
            request_tokens=tokens,
            threads=args.threads,
            tcp_connections=args.tcp_connections or args.threads,
            iterations=iters,
            latency_iterations=lat_iters,
            quick=args.quick,
            pool_memory="anonymous, MADV_HUGEPAGE, tensors 2 MiB aligned",
        ),
        "plan_us_128_blocks_x_64_tensors": plan_s * 1e6,
        "memcpy_gbps": {},
        "transports": {t: {} for t in args.transports},
    }
    for block_tokens in (16, 128):
        layout = Layout(block_tokens, pool_bytes)
        name = f"block{block_tokens}"
        server = Server(serve_command(layout, args.threads))
        try:
            for transport in args.transports:
                report["transports"][transport][name] = measure_transport(
                    refs,
                    transport,
                    layout,
                    server,
                    tokens,
                    iters,
                    lat_iters,
                    args.threads,
                    args.tcp_connections,
                )
        finally:
            server_stats = server.stop()
        memcpy = [report["transports"][t][name]["memcpy_gbps"] for t in args.transports]
        report["memcpy_gbps"][name] = statistics.median(memcpy)
        for transport in args.transports:
            peak = int(server_stats.get("peak_internal_bytes", 0))
            report["transports"][transport][name]["server_peak_internal_bytes"] = peak
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hixl_connector bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short run: 256 MiB pool, 512 tokens")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart")
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["cma", "tcp"])
    parser.add_argument("--threads", type=int, default=2, help="transfer and memcpy threads")
    parser.add_argument(
        "--tcp-connections",
        type=int,
        default=None,
        metavar="N",
        help="tcp connections per link (default: one per transfer thread)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--block-tokens", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--pool-bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve:
        serve(Layout(args.block_tokens, args.pool_bytes), args.threads)
        return 0
    report = run(args)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
