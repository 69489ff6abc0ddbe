"""A long prompt's KV over a rate-limited link between two hosts: pull, push after P's prefill,
and push layer by layer while P computes; how much of the transfer hides behind the prefill.

P and D each run in a network namespace made here (root needed; removed at the end), joined
by a veth pair whose P end sends at ``--rate`` (a token bucket): the side channel and the
engines' TCP transport cross it, HTTP runs over a management network. The model is the tiny
``llama-wide`` (8 layers, 32 KiB of KV per token), and P takes a whole prompt in one step
(``--max-num-batched-tokens`` is the longest prompt), so that push mode can write each layer
while the next one computes. For each prompt length, each way runs ``--repeats`` times on a
fresh prompt, after one warm-up:

- pull: P's leg (one token), then D's leg with P's answer: D reads the KV once P answered.
- push after P: P's leg, then D's leg naming P's push identity, as the router's first
  request to a P: D registers after P's prefill, and P writes the whole KV then.
- push while P computes: both legs at once, as the router's later requests: D registers
  first, and P writes each layer from ``save_kv_layer`` while the next computes.

TTFT runs from the first leg sent until both legs answered (the router forwards D's stream
after P's answer; D's leg asks for one token). P's prefill is its own leg's time in the same
request. The exposed transfer is TTFT minus that; the share hidden is
1 - exposed(while P computes) / exposed(push after P). The goal: the layered push exposes at
most one layer's transfer (the prompt's KV / layers / rate). D's token must be P's, and
every push while P computes must have been written layer by layer (P's counter).

    python -m hixl_connector bench-link [--rate 1gbit] [--input-lens 2048,4096]
                                        [--repeats 3] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    Generation,
    metric_total,
    push_identity,
    read_metrics,
    send_leg,
)
from hixl_connector.tools.demo.pd_demo import connector_config
from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    VllmServer,
    vllm_server_argv,
    vllm_server_env,
)
from hixl_connector.tools.demo.tiny_model import WIDE_MAX_POSITIONS, build_tiny_model
from hixl_connector.tools.netns import NetnsBed, make_bed

KV_CACHE_BYTES = 2 << 30
HEALTH_TIMEOUT_S = 300.0
LEG_TIMEOUT_S = 300.0
WAYS = ("pull", "push after P", "push while P computes")


@dataclass
class Samples:
    """One way at one prompt length: each request's TTFT and P's prefill, in seconds."""

    ttft_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    mismatches: int = 0
    layered: int | None = None  # pushes P wrote layer by layer, the warm-up's included

    @property
    def exposed_s(self) -> float:
        return statistics.median(t - p for t, p in zip(self.ttft_s, self.prefill_s, strict=True))


class Pair:
    """P and D in one transfer mode, in their namespaces; the legs of one request."""

    def __init__(self, prefill: VllmServer, decode: VllmServer) -> None:
        self.prefill, self.decode = prefill, decode
        self.identity: dict[str, Any] = {}
        self._pool = ThreadPoolExecutor(2)

    def leg(
        self, server: VllmServer, prompt: list[int], params: dict[str, Any], rid: str
    ) -> Generation:
        return send_leg(
            server.url,
            prompt,
            params,
            rid,
            model=SERVED_MODEL_NAME,
            max_tokens=1,
            timeout_s=LEG_TIMEOUT_S,
        )

    def sequential(self, prompt: list[int], push: bool) -> tuple[float, float, bool]:
        """P's leg, then D's: TTFT, P's time, and whether D's token is P's."""
        rid, began = uuid.uuid4().hex, time.monotonic()
        p_out = self.leg(self.prefill, prompt, dict(PREFILL_LEG_PARAMS), rid)
        prefill_s = time.monotonic() - began
        params = p_out.kv_transfer_params or {}
        if push:
            self.identity = params = push_identity(params)
        d_out = self.leg(self.decode, prompt, params, rid)
        return time.monotonic() - began, prefill_s, _same_token(p_out, d_out)

    def concurrent(self, prompt: list[int]) -> tuple[float, float, bool]:
        """Both legs at once (D first, as a router may well deliver it)."""
        rid, began = uuid.uuid4().hex, time.monotonic()
        d_leg = self._pool.submit(self.leg, self.decode, prompt, dict(self.identity), rid)
        p_out = self.leg(self.prefill, prompt, dict(PREFILL_LEG_PARAMS), rid)
        prefill_s = time.monotonic() - began
        d_out = d_leg.result(LEG_TIMEOUT_S)
        return time.monotonic() - began, prefill_s, _same_token(p_out, d_out)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _same_token(p_out: Generation, d_out: Generation) -> bool:
    return bool(d_out.token_ids) and d_out.token_ids[:1] == p_out.token_ids[:1]


def _server(
    net: NetnsBed, model: Path, logs: Path, role: str, mode: str, max_len: int
) -> VllmServer:
    ns, data_ip, http_ip, core = {
        "prefill": (net.ns_p, net.p_ip, net.p_http, 0),
        "decode": (net.ns_d, net.d_ip, net.d_http, 1),
    }[role]
    config = connector_config(role)
    config["kv_connector_extra_config"].update(
        transfer_mode=mode,
        transport="tcp",
        side_channel_host=data_ip,
        engine_host=data_ip,
        pull_timeout_s=LEG_TIMEOUT_S,
        lease_s=LEG_TIMEOUT_S,
    )
    port = free_port()
    argv = vllm_server_argv(
        model,
        port,
        core=core,
        kv_transfer_config=config,
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=max_len,
        extra_args=["--host", http_ip, "--max-num-batched-tokens", str(max_len)],
    )
    env = vllm_server_env()
    server = VllmServer(role, [*net.exec_prefix(ns), *argv], logs / f"{role}.log", port, env)
    server.url = f"http://{http_ip}:{port}"
    server.start()
    return server


@contextmanager
def pair(net: NetnsBed, model: Path, logs: Path, mode: str, max_len: int) -> Iterator[Pair]:
    started: list[VllmServer] = []
    try:
        for role in ("prefill", "decode"):
            started.append(_server(net, model, logs / mode, role, mode, max_len))
        for server in started:
            server.wait_healthy(HEALTH_TIMEOUT_S)
        both = Pair(*started)
        try:
            yield both
        finally:
            both.close()
    finally:
        for server in reversed(started):
            server.stop()


def measure(
    run: Callable[[list[int]], tuple[float, float, bool]], length: int, repeats: int, seed: int
) -> Samples:
    """One warm-up, then ``repeats`` requests, each on a prompt of its own (sharing no
    prefix with another: either side's prefix cache would shorten prefill and transfer)."""
    samples = Samples()
    for i in range(repeats + 1):
        rng = random.Random(f"{seed}-{length}-{i}")
        # Ids 0..2 are the tiny tokenizer's special tokens; it has over 440 ids.
        ttft, prefill, same = run([rng.randrange(3, 440) for _ in range(length)])
        if i:
            samples.ttft_s.append(ttft)
            samples.prefill_s.append(prefill)
            samples.mismatches += not same
    return samples


@dataclass(frozen=True)
class KVShape:
    """What the model caches: its layers, and the bytes of K and V per token in all of them."""

    layers: int
    bytes_per_token: int

    @classmethod
    def of(cls, model_dir: Path) -> KVShape:
        config = json.loads((model_dir / "config.json").read_text())
        layers = config["num_hidden_layers"]
        head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        width = config["num_key_value_heads"] * head_size * 4  # float32, as the servers run
        return cls(layers, 2 * layers * width)


def layered_pushes(prefill: VllmServer) -> float:
    return metric_total(read_metrics(prefill.url), "vllm:hixl_layered_pushes_total")


def rate_bits(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    bits = float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]] if match else 0.0
    if bits <= 0:
        raise ValueError(f"--rate takes a positive tc rate such as 1gbit or 500mbit, got {rate!r}")
    return bits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-link")
    parser.add_argument("--rate", default="1gbit", help="what P's end of the link sends")
    parser.add_argument("--input-lens", default="2048,4096", help="comma-separated lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default="")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.input_lens.split(",")]
    max_len = max(lengths) + 64  # room for the answer
    if min(lengths) < 1 or max_len > WIDE_MAX_POSITIONS:
        parser.error(f"--input-lens must lie within 1..{WIDE_MAX_POSITIONS - 64}")
    bits_per_s = rate_bits(args.rate)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hixl-bench-link-"))
    model = build_tiny_model(work / "model", "llama-wide")
    results: dict[tuple[str, int], Samples] = {}
    net = make_bed()
    try:
        # A fast rate needs a bucket of at least a few milliseconds of it.
        net.throttle(args.rate, burst=f"{max(4, int(bits_per_s / 8 / 1024 / 200))}kb", limit="64mb")
        with pair(net, model, work / "logs", "pull", max_len) as pd:
            for n in lengths:
                results["pull", n] = measure(lambda p: pd.sequential(p, False), n, args.repeats, 1)
        with pair(net, model, work / "logs", "push", max_len) as pd:
            for n in lengths:
                results["push after P", n] = measure(
                    lambda p: pd.sequential(p, True), n, args.repeats, 2
                )
                before = layered_pushes(pd.prefill)
                results[WAYS[2], n] = measure(pd.concurrent, n, args.repeats, 3)
                time.sleep(2.0)  # P's counters reach its API server a step or so later
                results[WAYS[2], n].layered = int(layered_pushes(pd.prefill) - before)
    finally:
        net.remove()
    return report(results, lengths, args, KVShape.of(model), bits_per_s, work)


def report(
    results: dict[tuple[str, int], Samples],
    lengths: list[int],
    args: argparse.Namespace,
    kv: KVShape,
    bits_per_s: float,
    work: Path,
) -> int:
    print(
        f"P and D in two network namespaces, P's end of the link at {args.rate}; llama-wide "
        f"({kv.layers} layers, {kv.bytes_per_token // 1024} KiB of KV per token), one "
        f"core each; medians of {args.repeats} requests"
    )
    failures = 0
    for n in lengths:
        wire_s = n * kv.bytes_per_token * 8 / bits_per_s
        layer_s = wire_s / kv.layers
        print(
            f"  {n} tokens: {n * kv.bytes_per_token / 2**20:.0f} MiB of KV, "
            f"{wire_s * 1000:.0f} ms on the wire, {layer_s * 1000:.0f} ms a layer"
        )
        for way in WAYS:
            s = results[way, n]
            failures += s.mismatches
            how = ""
            if s.layered is not None:
                how = f"; {s.layered} of {args.repeats + 1} written layer by layer"
                failures += s.layered < args.repeats + 1
            print(
                f"    {way:22s} TTFT {statistics.median(s.ttft_s) * 1000:7.0f} ms, P's prefill "
                f"{statistics.median(s.prefill_s) * 1000:6.0f} ms, exposed transfer "
                f"{s.exposed_s * 1000:6.0f} ms ({s.exposed_s / layer_s:.1f} layers){how}"
            )
        whole, layered = results["push after P", n].exposed_s, results[WAYS[2], n].exposed_s
        print(
            f"    hidden behind P's prefill: {1 - layered / whole:.0%} of the exposed push; "
            f"goal (at most one layer's transfer exposed): "
            f"{'met' if layered <= layer_s else 'not met'}"
        )
    if failures:
        print(f"  {failures} failure(s): D's first token not P's, or a push not layered")
    print(f"  files: {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
