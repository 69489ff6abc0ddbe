"""``python -m hixl_connector soak``: many requests through router, P and D; nothing may drift.

1. A plain vLLM server answers every request (the reference), then stops.
2. P, D (hixl_connector) and vllm-router in PD mode start; the same requests go through the
   router at the given concurrency, after ``--warmup`` requests (checked too) that let
   vLLM's allocators reach their working size.
3. Checks: every output token-identical to the plain run; no request failed; vLLM's KV usage
   gauge on P and D back to idle (no leaked block); the resident memory of every process
   (servers, their EngineCores, the router) flat between the end of the warm-up and the end:
   no process may grow more than the plain server grew over the same requests plus a
   tolerance.
Every server runs with oneDNN's primitive cache off (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``).
That cache keeps one compiled kernel per matmul shape, up to 1024 of them, and with prompts of
varied length a plain vLLM CPU server grew by 352 MiB over 1000 requests after warm-up:
noise large enough to hide a real leak. With the cache off it stayed within 12 MiB, so the
tolerance can be tight: with the defaults, a leak of 128 KiB per request in P or D fails the
500-request form.
It prints a summary (requests, failures, p50/p99 of KV-ready and of pull latency on D over
the measured requests, from D's own histograms) and exits 1 on any mismatch, failure, leak
or growth beyond the tolerance.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import RequestFailed, complete, metric_total, read_metrics
from hixl_connector.tools.demo.pd_demo import connector_config
from hixl_connector.tools.demo.processes import ManagedProcess, signals_as_interrupt
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, start_router, start_vllm_server
from hixl_connector.tools.demo.tiny_model import build_tiny_model, is_built

HEALTH_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
KV_READY_METRIC = "vllm:hixl_kv_ready_seconds_bucket"
PULL_METRIC = "vllm:hixl_pull_seconds_bucket"
QUANTILES = (0.5, 0.99)
# Same settings for the plain server and for P and D; see the module's docstring.
SERVER_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


@dataclass
class SoakResult:
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    growth_mb: dict[str, float] = field(default_factory=dict)
    rss_trace: list[float] = field(default_factory=list)  # total MiB after each quarter
    # The control: the most any process of the plain server grew over the same requests.
    plain_growth_mb: float = 0.0
    kv_ready_ms: tuple[float, float] = (0.0, 0.0)
    pull_ms: tuple[float, float] = (0.0, 0.0)
    timings_s: dict[str, float] = field(default_factory=dict)

    def problems(self, tolerance_mb: float) -> list[str]:
        found = [f"{len(self.failures)} failed requests"] if self.failures else []
        if self.mismatches:
            found.append(f"{len(self.mismatches)} outputs differ from the plain run")
        found += self.leaks
        # A process may grow as much as the plain server did (vLLM itself) plus the tolerance.
        allowed = self.plain_growth_mb + tolerance_mb
        found += [
            f"{name} grew {mb:.1f} MiB (the plain server {self.plain_growth_mb:.1f})"
            for name, mb in self.growth_mb.items()
            if mb > allowed
        ]
        return found


def workload(count: int, seed: int) -> list[list[int]]:
    """Token-id prompts of varied length (1 token to ~12 blocks), each distinct."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 450) for _ in range(rng.randint(1, 400))] for _ in range(count)]


def run_all(
    url: str,
    prompts: Sequence[list[int]],
    indices: Sequence[int],
    max_tokens: int,
    concurrency: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[int, list[int] | str]:
    """Token ids per prompt index, or the error text of a failed request."""

    def one(i: int) -> list[int] | str:
        try:
            return complete(
                url,
                prompts[i],
                model=SERVED_MODEL_NAME,
                max_tokens=max_tokens,
                extra=extra,
                timeout_s=REQUEST_TIMEOUT_S,
            ).token_ids
        except RequestFailed as e:
            return str(e)

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(zip(indices, pool.map(one, indices), strict=True))


def rss_mb(processes: Mapping[str, ManagedProcess]) -> dict[str, float]:
    """Resident MiB of every process and its children, keyed "server/name[pid]"."""
    import psutil

    sizes: dict[str, float] = {}
    for label, process in processes.items():
        if process.pid is None:
            continue
        try:
            root = psutil.Process(process.pid)
            for proc in [root, *root.children(recursive=True)]:
                sizes[f"{label}/{proc.name()}[{proc.pid}]"] = proc.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return sizes


def histogram_buckets(samples: Mapping[str, float], metric: str) -> dict[float, float]:
    """Cumulative counts of one of D's latency histograms, by upper bound (s)."""
    buckets: dict[float, float] = {}
    for key, value in samples.items():
        if key.startswith(metric + "{"):
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def histogram_quantiles(
    before: Mapping[str, float],
    after: Mapping[str, float],
    metric: str,
    quantiles: Sequence[float],
) -> list[float]:
    """Quantiles (ms) of what one of D's latency histograms gained between two scrapes,
    interpolated within buckets."""
    earlier = histogram_buckets(before, metric)
    ordered = sorted(
        (bound, count - earlier.get(bound, 0.0))
        for bound, count in histogram_buckets(after, metric).items()
    )
    total = ordered[-1][1] if ordered else 0.0
    out = []
    for q in quantiles:
        rank, low, below = q * total, 0.0, 0.0
        result = 0.0
        for bound, count in ordered:
            if count >= rank and total > 0:
                top = low if bound == float("inf") else bound
                span = count - below
                result = low + (top - low) * ((rank - below) / span if span else 0.0)
                break
            low, below = bound, count
        out.append(result * 1000)
    return out


def wait_idle(url: str, name: str, timeout_s: float) -> str | None:
    """None once vLLM reports no KV block in use and no request; else what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = read_metrics(url)
        usage = metric_total(samples, "vllm:kv_cache_usage_perc")
        busy = metric_total(samples, "vllm:num_requests_running") + metric_total(
            samples, "vllm:num_requests_waiting"
        )
        if usage == 0.0 and busy == 0.0:
            return None
        if time.monotonic() > deadline:
            return f"{name} still holds {usage:.2%} of its KV blocks ({busy:.0f} requests)"
        time.sleep(0.2)


def soak(args: argparse.Namespace, say: Callable[[str], None]) -> SoakResult:
    result = SoakResult(requests=args.requests)
    work = Path(args.work_dir)
    model_dir = work / "model"
    if not is_built(model_dir):
        say(f"building the tiny model into {model_dir}")
        build_tiny_model(model_dir)
    prompts = workload(args.warmup + args.requests, args.seed)
    everything = list(range(len(prompts)))
    began = time.monotonic()
    plain = start_vllm_server(model_dir, work / "logs", "plain", core=0, extra_env=SERVER_ENV)
    try:
        plain.wait_healthy(HEALTH_TIMEOUT_S)
        say(f"plain server up; {len(prompts)} reference requests at concurrency {args.concurrency}")
        reference = run_all(
            plain.url, prompts, everything[: args.warmup], args.max_tokens, args.concurrency
        )
        baseline = rss_mb({"plain": plain})
        reference.update(
            run_all(
                plain.url, prompts, everything[args.warmup :], args.max_tokens, args.concurrency
            )
        )
        final = rss_mb({"plain": plain})
        result.plain_growth_mb = max(
            (final[k] - baseline[k] for k in baseline if k in final), default=0.0
        )
    finally:
        plain.stop()
    result.timings_s["plain_run"] = time.monotonic() - began
    if any(isinstance(v, str) for v in reference.values()):
        raise RuntimeError(
            "the plain server failed requests: "
            + str(next(v for v in reference.values() if isinstance(v, str)))[:300]
        )

    began = time.monotonic()
    servers: dict[str, ManagedProcess] = {}
    try:
        servers["prefill"] = start_vllm_server(
            model_dir, work / "logs", "prefill", core=0,
            kv_transfer_config=connector_config("prefill"), extra_env=SERVER_ENV,
        )  # fmt: skip
        servers["decode"] = start_vllm_server(
            model_dir, work / "logs", "decode", core=1,
            kv_transfer_config=connector_config("decode"), extra_env=SERVER_ENV,
        )  # fmt: skip
        for name in ("prefill", "decode"):
            servers[name].wait_healthy(HEALTH_TIMEOUT_S)  # type: ignore[attr-defined]
        prefill_url = servers["prefill"].url  # type: ignore[attr-defined]
        decode_url = servers["decode"].url  # type: ignore[attr-defined]
        router = start_router([prefill_url], [decode_url], work / "logs")
        servers["router"] = router
        router.wait_healthy(60.0)
        result.timings_s["pd_start"] = time.monotonic() - began

        warm = args.warmup
        say(f"P, D and router up; warm-up with {warm} requests")
        outputs = run_all(router.url, prompts, everything[:warm], args.max_tokens, args.concurrency)
        for name, url in (("prefill", prefill_url), ("decode", decode_url)):
            if left := wait_idle(url, name, IDLE_TIMEOUT_S):
                result.leaks.append("after warm-up: " + left)
        before = rss_mb(servers)
        # The percentiles are of the measured requests: the warm-up's first reads link P.
        metrics_before = read_metrics(decode_url)
        began = time.monotonic()
        say(f"soak: {len(prompts) - warm} requests at concurrency {args.concurrency}")
        measured = everything[warm:]
        quarter = max(1, len(measured) // 4)
        for start in range(0, len(measured), quarter):
            chunk = measured[start : start + quarter]
            outputs.update(run_all(router.url, prompts, chunk, args.max_tokens, args.concurrency))
            result.rss_trace.append(sum(rss_mb(servers).values()))
        result.timings_s["pd_run"] = time.monotonic() - began
        for name, url in (("prefill", prefill_url), ("decode", decode_url)):
            if left := wait_idle(url, name, IDLE_TIMEOUT_S):
                result.leaks.append(left)
        after = rss_mb(servers)
        result.growth_mb = {k: after[k] - before[k] for k in before if k in after}
        metrics_after = read_metrics(decode_url)
        p50, p99 = histogram_quantiles(metrics_before, metrics_after, KV_READY_METRIC, QUANTILES)
        result.kv_ready_ms = (p50, p99)
        p50, p99 = histogram_quantiles(metrics_before, metrics_after, PULL_METRIC, QUANTILES)
        result.pull_ms = (p50, p99)
    finally:
        for process in reversed(list(servers.values())):
            process.stop()
    for i in everything:
        got = outputs.get(i)
        if isinstance(got, str) or got is None:
            result.failures.append(f"request {i}: {got}")
        elif got != reference[i]:
            result.mismatches.append(i)
    return result


def summary(result: SoakResult, args: argparse.Namespace) -> str:
    lines = [
        f"soak: {result.requests} requests (after {args.warmup} warm-up) at concurrency "
        f"{args.concurrency}, "
        f"{args.max_tokens} output tokens each",
        f"  failures: {len(result.failures)}   output mismatches: {len(result.mismatches)}",
        f"  KV-ready latency on D: p50 {result.kv_ready_ms[0]:.2f} ms, "
        f"p99 {result.kv_ready_ms[1]:.2f} ms; pull alone: p50 {result.pull_ms[0]:.2f} ms, "
        f"p99 {result.pull_ms[1]:.2f} ms (from D's histograms)",
        "  leaked blocks: "
        + ("none (P and D back to idle)" if not result.leaks else "; ".join(result.leaks)),
        "  memory growth after warm-up (MiB): "
        + ", ".join(f"{k} {v:+.1f}" for k, v in sorted(result.growth_mb.items())),
        f"  the plain server grew {result.plain_growth_mb:+.1f} MiB over the same requests",
        "  total resident MiB after each quarter: "
        + ", ".join(f"{mb:.0f}" for mb in result.rss_trace),
        "  time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in result.timings_s.items()),
    ]
    problems = result.problems(args.rss_tolerance_mb)
    lines.append("  RESULT: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    lines += [f"    {f}" for f in result.failures[:5]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hixl_connector soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup", type=int, default=200, help="requests before the memory baseline"
    )
    parser.add_argument(
        "--rss-tolerance-mb",
        type=float,
        default=32.0,
        help="allowed growth per process after warm-up beyond the plain server's growth",
    )
    parser.add_argument("--work-dir", default="artifacts/soak")
    parser.add_argument("--json", default="", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.warmup < 0:
        parser.error("--requests, --concurrency, --max-tokens must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", flush=True)

    with signals_as_interrupt():
        result = soak(args, say)
    print(summary(result, args), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result.__dict__, indent=2, default=list) + "\n")
    return 1 if result.problems(args.rss_tolerance_mb) else 0


if __name__ == "__main__":
    sys.exit(main())
