"""Benchmark of TP-mismatched pulls against equal-TP pulls of the same bytes, in one run.

Llama-8B KV shape (32 layers, K and V tensors = 64 tensors, 8 KV heads, head_dim 128, bf16),
16-token blocks, every tensor registered one unit per KV head of a block, as the connector
registers vLLM's CPU KV cache. The unit ids come from ``tp_mapping`` and the calls run as
one ``pull_blocks_batch_async``, as the worker runs them (reads from several P ranks one after
another, each spread over the engine's transfer threads). Fresh random block ids for every
pull; each case alternates with its reference:

- "P tp2 -> D tp1": a D rank holding all 8 heads reads heads 0-3 from one 4-head P rank and
  4-7 from another (two ``pull_blocks``, each into half of every block), against the
  equal-TP pull of 8-head blocks from an 8-head P (the same bytes);
- "P tp1 -> D tp2": a D rank holding 4 heads reads its half of each 8-head block from the
  one P rank, against the equal-TP pull of 4-head blocks from a 4-head P (the same bytes).

"ratio" is the median of per-pair ratios (reference time / mismatched time): at least 0.9
means the mismatch costs at most a tenth. The engine's peak internal memory shows that
nothing is staged.

    python -m hixl_connector bench-tp [--quick] [--transports cma,tcp] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl_connector.connector.mapping.tp_mapping import plan_rank, unit_ids
from hixl_connector.datadist import BlocksPull, load_backend
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

BLOCK_TOKENS = 16
UNIT_BYTES = BLOCK_TOKENS * 2 * HEAD_DIM * DTYPE_BYTES // 2  # one head's K or V of a block
CLIENT_CLUSTER = 100


def _pool(num_units: int, fill: int) -> list[np.ndarray]:
    return alloc_tensors(num_units * UNIT_BYTES, [fill] * NUM_TENSORS)


def _register(dd: Any, tensors: list[np.ndarray], num_units: int, key: Any) -> Any:
    api = datadist_api()
    desc = api.CacheDesc(
        NUM_TENSORS, [num_units, UNIT_BYTES], api.DataType.DT_UINT8, api.Placement.HOST
    )
    return dd.cache_manager.register_blocks_cache(
        desc, [int(t.ctypes.data) for t in tensors], key, remote_accessible=True
    )


def serve(heads: int, num_blocks: int, cluster: int, threads: int) -> None:
    """One P rank holding ``heads`` KV heads per block; serves until stdin closes."""
    api = datadist_api()
    dd = api.LLMDataDist(api.LLMRole.PROMPT, cluster)
    dd.init(engine_options(None, threads, "127.0.0.1:0"))
    tensors = _pool(num_blocks * heads, cluster & 0xFF)
    _register(dd, tensors, num_blocks * heads, api.BlocksCacheKey(cluster, 0))
    print(json.dumps({"port": dd.listen_port, "pid": 0, "bases": []}), flush=True)
    sys.stdin.read()
    print(json.dumps(dd.engine_stats()), flush=True)
    dd.finalize()


@dataclass
class PRank:
    heads: int
    cluster: int
    server: Server

    @classmethod
    def start(cls, heads: int, num_blocks: int, cluster: int, threads: int) -> PRank:
        cmd = [
            sys.executable,
            "-m",
            "hixl_connector.tools.bench_tp",
            "--serve",
            "--heads",
            str(heads),
        ]
        cmd += ["--blocks", str(num_blocks), "--cluster", str(cluster), "--threads", str(threads)]
        return cls(heads, cluster, Server(cmd))


class DRank:
    """One D rank with its own engine and pool, linked to the P ranks it reads."""

    def __init__(self, heads: int, num_blocks: int, transport: str, threads: int) -> None:
        api = datadist_api()
        self.heads = heads
        self.dd = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER + heads)
        self.dd.init(engine_options(transport, threads, None))
        self.pool = _pool(num_blocks * heads, 0)
        self.cache = _register(self.dd, self.pool, num_blocks * heads, None)

    def link(self, rank: PRank) -> None:
        link(self.dd, rank.cluster, rank.server.port)

    def pull(self, ranks: list[PRank], d_tp: int, src: list[int], dst: list[int]) -> float:
        """Every read ``tp_mapping`` plans for rank 0 of a D engine of TP ``d_tp`` reading a
        P engine of these ranks, timed together."""
        api = load_backend("native", None)
        plan = plan_rank(KV_HEADS, len(ranks), d_tp, 0)
        pulls = [
            BlocksPull(
                api.BlocksCacheKey(ranks[read.p_rank].cluster, 0),
                self.cache,
                unit_ids(src, ranks[read.p_rank].heads, read.src_head, read.count),
                unit_ids(dst, self.heads, read.dst_head, read.count),
                {"tensor_num_per_layer": 2},  # K and V
            )
            for read in plan.reads
        ]
        start = time.perf_counter()
        api.pull_blocks_batch_async(self.dd.cache_manager, pulls).wait()
        elapsed = time.perf_counter() - start
        for read in plan.reads:  # each head slot holds the bytes of the P rank it came from
            unit = dst[0] * self.heads + read.dst_head
            if int(self.pool[-1][unit * UNIT_BYTES]) != ranks[read.p_rank].cluster & 0xFF:
                raise RuntimeError(f"head slot {read.dst_head} holds the wrong bytes")
        return elapsed

    def close(self) -> int:
        peak = int(self.dd.engine_stats().get("peak_internal_bytes", 0))
        self.dd.finalize()
        return peak


def measure(
    transport: str, threads: int, tokens: int, num_blocks: int, iters: int
) -> dict[str, dict[str, float]]:
    p8 = PRank.start(8, num_blocks, 11, threads)
    p4 = [PRank.start(4, num_blocks, cluster, threads) for cluster in (12, 13)]
    try:
        # name: (D heads, D tp, P ranks of the reference, P ranks of the mismatched pull);
        # within each pair the same bytes move (one LLMDataDist per process: one D at a time).
        cases = {
            "P tp2 -> D tp1": (8, 1, [p8], p4),
            "P tp1 -> D tp2": (4, 2, p4, [p8]),
        }
        rng = np.random.default_rng(5)
        count = tokens // BLOCK_TOKENS
        result = {}
        for name, (heads, d_tp, reference_ranks, mismatched_ranks) in cases.items():
            d = DRank(heads, num_blocks, transport, threads)
            try:
                for rank in {id(r): r for r in reference_ranks + mismatched_ranks}.values():
                    d.link(rank)
                times: list[list[float]] = [[], []]
                for it in range(iters + 1):  # the first round warms pages and paths up
                    for which in (it % 2, 1 - it % 2):
                        ranks = (reference_ranks, mismatched_ranks)[which]
                        src = rng.choice(num_blocks, count, replace=False).tolist()
                        dst = rng.choice(num_blocks, count, replace=False).tolist()
                        elapsed = d.pull(ranks, d_tp, src, dst)
                        if it:
                            times[which].append(elapsed)
            finally:
                peak = d.close()
            nbytes = NUM_TENSORS * count * heads * UNIT_BYTES
            result[name] = {
                "gbps": nbytes / statistics.median(times[1]) / 1e9,
                "reference_gbps": nbytes / statistics.median(times[0]) / 1e9,
                "ratio": median_ratio(times[0], times[1]),
                "client_peak_internal_bytes": peak,  # nothing staged: stays at KiB
            }
        return result
    finally:
        for rank in (p8, *p4):
            rank.server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hixl_connector bench-tp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short run: 256-token requests")
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["cma", "tcp"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve:
        serve(args.heads, args.blocks, args.cluster, args.threads)
        return 0
    tokens, iters = (256, 5) if args.quick else (2048, 15)
    num_blocks = 4 * tokens // BLOCK_TOKENS
    report = {
        transport: measure(transport, args.threads, tokens, num_blocks, iters)
        for transport in args.transports
    }
    print(
        f"TP-mismatched pull_blocks vs equal TP, same bytes: {LAYERS} layers x K/V, "
        f"{KV_HEADS} KV heads, {BLOCK_TOKENS}-token blocks, {tokens}-token request, "
        f"{args.threads} threads"
    )
    print(f"{'transport':>9}  {'case':>15}  {'GB/s':>6}  {'equal-TP GB/s':>13}  {'ratio':>5}")
    for transport, cases in report.items():
        for name, f in cases.items():
            peak_kib = int(f["client_peak_internal_bytes"]) >> 10
            print(
                f"{transport:>9}  {name:>15}  {f['gbps']:6.2f}  {f['reference_gbps']:13.2f}  "
                f"{f['ratio']:5.2f}   (peak internal {peak_kib} KiB)"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
