"""Benchmark of ``pull_blocks`` between two processes on the native engine.

Layout: Llama-8B KV cache (32 layers, K and V as separate tensors = 64 tensors, 8 KV heads,
head_dim 128, bf16), blocks of 16 and 128 tokens, a 1 GiB pool per side. Measured per transport:
a 2048-token request with fresh random block ids each iteration, 1-block and 8-block latency,
and, in the same run, an in-process scatter memcpy of the same ops with the same thread count
(the physical limit) and the planning time of 128 blocks x 64 tensors.

    python -m hixl_connector bench [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
NUM_TENSORS = 2 * LAYERS
SERVER_CLUSTER, CLIENT_CLUSTER = 1, 2
READY_TIMEOUT_S = 120.0


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


def _api() -> Any:
    from hixl_connector import datadist

    return datadist


def _alloc_pool(layout: Layout, fill: bool) -> list[np.ndarray]:
    nbytes = layout.num_blocks * layout.block_bytes
    # Filled pages: an untouched pool would be served from the shared zero page.
    return [np.full(nbytes, (t + 1) & 0xFF if fill else 0, np.uint8) for t in range(NUM_TENSORS)]


def _register(dd: Any, layout: Layout, tensors: list[np.ndarray], key: Any) -> Any:
    api = _api()
    desc = api.CacheDesc(
        NUM_TENSORS,
        [layout.num_blocks, layout.block_tokens, KV_HEADS, HEAD_DIM],
        api.DataType.DT_BF16,
        api.Placement.HOST,
    )
    return dd.cache_manager.register_blocks_cache(
        desc, [t.ctypes.data for t in tensors], key, remote_accessible=True
    )


def _options(transport: str | None, threads: int, listen: str | None) -> dict[str, str]:
    config = _api().LLMConfig()
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
    return config.generate_options()


def serve(layout: Layout, threads: int) -> None:
    """The prefill side: serve one pool until stdin closes, then print the engine's stats."""
    api = _api()
    dd = api.LLMDataDist(api.LLMRole.PROMPT, SERVER_CLUSTER)
    dd.init(_options(None, threads, "127.0.0.1:0"))
    tensors = _alloc_pool(layout, fill=True)
    _register(dd, layout, tensors, api.BlocksCacheKey(SERVER_CLUSTER, 0))
    print(json.dumps({"port": dd.listen_port}), flush=True)
    sys.stdin.read()
    print(json.dumps(dd.engine_stats()), flush=True)
    dd.finalize()


class Server:
    def __init__(self, layout: Layout, threads: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "hixl_connector.bench",
            "--serve",
            "--block-tokens",
            str(layout.block_tokens),
            "--pool-bytes",
            str(layout.pool_bytes),
            "--threads",
            str(threads),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError("benchmark server did not start")
        self.port = int(json.loads(line)["port"])

    def stop(self) -> dict[str, int]:
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return {}
        lines = out.strip().splitlines()
        return dict(json.loads(lines[-1])) if lines else {}


def _random_pairs(
    rng: np.random.Generator, num_blocks: int, count: int
) -> tuple[list[int], list[int]]:
    src = rng.choice(num_blocks, count, replace=False).tolist()
    dst = rng.choice(num_blocks, count, replace=False).tolist()
    return src, dst


def _ops(
    native: Any,
    src: list[int],
    dst: list[int],
    src_pool: list[np.ndarray],
    dst_pool: list[np.ndarray],
    block_bytes: int,
) -> tuple[list[int], list[int], list[int]]:
    """The engine's plan as (dst, src, length) lists: one op per tensor per run."""
    dst_addrs, src_addrs, lengths = [], [], []
    for src_start, dst_start, length in native.plan_runs(src, dst):
        for t in range(NUM_TENSORS):
            dst_addrs.append(dst_pool[t].ctypes.data + dst_start * block_bytes)
            src_addrs.append(src_pool[t].ctypes.data + src_start * block_bytes)
            lengths.append(length * block_bytes)
    return dst_addrs, src_addrs, lengths


def measure_memcpy(
    native: Any, layout: Layout, pool: list[np.ndarray], tokens: int, iters: int, threads: int
) -> float:
    """GB/s of an in-process scatter copy of a request's ops, between disjoint blocks of a pool."""
    rng = np.random.default_rng(7)
    count = tokens // layout.block_tokens
    seconds, total = [], 0
    for _ in range(iters):
        ids = rng.choice(layout.num_blocks, 2 * count, replace=False).tolist()
        ops = _ops(native, ids[:count], ids[count:], pool, pool, layout.block_bytes)
        total = sum(ops[2])
        seconds.append(native.scatter_copy(*ops, threads))
    return total / statistics.median(seconds) / 1e9


def measure_transport(
    transport: str, layout: Layout, port: int, tokens: int, iters: int, lat_iters: int, threads: int
) -> dict[str, Any]:
    api = _api()
    dd = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER)
    dd.init(_options(transport, threads, None))
    try:
        pool = _alloc_pool(layout, fill=False)
        cache = _register(dd, layout, pool, None)
        info = api.LLMClusterInfo()
        info.remote_cluster_id = SERVER_CLUSTER
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        ret, rets = dd.link_clusters([info], 10000)
        if ret != api.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link over {transport} failed: {ret} {rets}")
        key = api.BlocksCacheKey(SERVER_CLUSTER, 0)
        rng = np.random.default_rng(11)

        def timed_pull(count: int) -> float:
            src, dst = _random_pairs(rng, layout.num_blocks, count)
            start = time.perf_counter()
            dd.cache_manager.pull_blocks(key, cache, src, dst)
            elapsed = time.perf_counter() - start
            if int(pool[NUM_TENSORS - 1][dst[0] * layout.block_bytes]) != NUM_TENSORS & 0xFF:
                raise RuntimeError("pulled bytes do not match the server's pool")
            return elapsed

        count = tokens // layout.block_tokens
        timed_pull(count)  # warm-up: first touch of the destination pages
        request = [timed_pull(count) for _ in range(iters)]
        one = [timed_pull(1) for _ in range(lat_iters)]
        eight = [timed_pull(8) for _ in range(lat_iters)]
        request_bytes = NUM_TENSORS * count * layout.block_bytes
        stats = dd.engine_stats()
        result = {
            "transport_used": dd.peer_transport(SERVER_CLUSTER),
            "request_gbps": request_bytes / statistics.median(request) / 1e9,
            "request_ms_p50": statistics.median(request) * 1e3,
            "one_block_us_p50": statistics.median(one) * 1e6,
            "eight_blocks_us_p50": statistics.median(eight) * 1e6,
            "client_peak_internal_bytes": int(stats.get("peak_internal_bytes", 0)),
        }
        dd.unlink_clusters([info], 5000)
        return result
    finally:
        dd.finalize()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hixl_connector.datadist.native import load_native

    _native = load_native()

    tokens = 512 if args.quick else 2048
    pool_bytes = (256 << 20) if args.quick else (1 << 30)
    iters, lat_iters = (2, 5) if args.quick else (10, 50)
    plan_blocks = np.random.default_rng(3).permutation(4096)[:256].tolist()
    plan_s = _native.time_plan(
        plan_blocks[:128], plan_blocks[128:], NUM_TENSORS, 200 if args.quick else 2000
    )
    report: dict[str, Any] = {
        "config": {
            "layers": LAYERS,
            "tensors": NUM_TENSORS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype_bytes": DTYPE_BYTES,
            "pool_bytes": pool_bytes,
            "request_tokens": tokens,
            "threads": args.threads,
            "iterations": iters,
            "latency_iterations": lat_iters,
            "quick": args.quick,
        },
        "plan_us_128_blocks_x_64_tensors": plan_s * 1e6,
        "memcpy_gbps": {},
        "transports": {t: {} for t in args.transports},
    }
    for block_tokens in (16, 128):
        layout = Layout(block_tokens, pool_bytes)
        name = f"block{block_tokens}"
        scratch = _alloc_pool(layout, fill=True)
        memcpy = measure_memcpy(_native, layout, scratch, tokens, max(iters, 3), args.threads)
        del scratch
        report["memcpy_gbps"][name] = memcpy
        server = Server(layout, args.threads)
        try:
            for transport in args.transports:
                figures = measure_transport(
                    transport, layout, server.port, tokens, iters, lat_iters, args.threads
                )
                figures["memcpy_gbps"] = memcpy
                figures["ratio_to_memcpy"] = figures["request_gbps"] / memcpy
                report["transports"][transport][name] = figures
        finally:
            server_stats = server.stop()
        for transport in args.transports:
            peak = int(server_stats.get("peak_internal_bytes", 0))
            report["transports"][transport][name]["server_peak_internal_bytes"] = peak
    return report


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    head = (
        f"pull_blocks, Llama-8B layout ({cfg['tensors']} tensors, bf16), {cfg['request_tokens']}"
        f"-token request, {cfg['pool_bytes'] >> 20} MiB pool/side, {cfg['threads']} threads"
    )
    cols = (
        "transport",
        "block",
        "GB/s",
        "memcpy GB/s",
        "ratio",
        "req ms",
        "1 blk us",
        "8 blk us",
        "peak int. KiB (cli/srv)",
    )
    rows = [cols]
    for transport, blocks in report["transports"].items():
        for name, f in blocks.items():
            rows.append(
                (
                    transport,
                    name.removeprefix("block"),
                    f"{f['request_gbps']:.2f}",
                    f"{f['memcpy_gbps']:.2f}",
                    f"{f['ratio_to_memcpy']:.2f}",
                    f"{f['request_ms_p50']:.1f}",
                    f"{f['one_block_us_p50']:.0f}",
                    f"{f['eight_blocks_us_p50']:.0f}",
                    f"{f['client_peak_internal_bytes'] >> 10}/"
                    f"{f['server_peak_internal_bytes'] >> 10}",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"planning 128 blocks x 64 tensors: {report['plan_us_128_blocks_x_64_tensors']:.1f} us"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["block16", "block128"]
    fig, ax = plt.subplots(figsize=(7, 4))
    series = {
        t: [report["transports"][t][n]["request_gbps"] for n in names] for t in report["transports"]
    }
    series["memcpy (limit)"] = [report["memcpy_gbps"][n] for n in names]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))])
    ax.set_xticklabels(["16-token blocks", "128-token blocks"])
    ax.set_ylabel("GB/s")
    ax.set_title(f"pull_blocks, {report['config']['request_tokens']}-token request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


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
