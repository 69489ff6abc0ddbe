"""The demo's requests and what it measures for each: outputs, latencies, D's transfer figures.

Each request goes to the plain reference server and then through the router (P then D), one
at a time, so the change in D's ``/metrics`` across a routed request belongs to that request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from hixl_connector.tools.demo.client import Generation, chat, complete, metric_total, read_metrics
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME
from hixl_connector.tools.demo.tiny_model import WORDS

# (kind, words in the prompt, streamed); the tiny tokenizer makes about one token per word,
# so these span a sub-block prompt up to about a dozen 32-token blocks.
REQUEST_PLAN: tuple[tuple[str, int, bool], ...] = (
    ("completion", 230, False),
    ("chat", 90, False),
    ("completion", 120, True),
    ("completion", 20, False),
    ("chat", 60, True),
    ("completion", 400, False),
)
MAX_PROMPT_WORDS = 600
STATS_WAIT_S = 10.0

# D's counters, by short name: (metric, labels). Histogram sums give seconds spent.
_DECODE_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    "pulls": ("vllm:hixl_pulls_total", {}),
    "blocks": ("vllm:hixl_pull_blocks_total", {}),
    "bytes": ("vllm:hixl_pull_bytes_total", {}),
    "pull_s": ("vllm:hixl_pull_seconds_sum", {}),
    "kv_ready_s": ("vllm:hixl_kv_ready_seconds_sum", {}),
    "failed_pulls": ("vllm:hixl_failed_pulls_total", {}),
    "failed_handshakes": ("vllm:hixl_failed_handshakes_total", {}),
    "sync_loads": ("vllm:hixl_sync_loads_total", {}),
    "external_tokens": (
        "vllm:prompt_tokens_by_source_total",
        {"source": "external_kv_transfer"},
    ),
}


@dataclass(frozen=True)
class RequestSpec:
    """One demo request: a completion prompt or chat messages, plain or streamed."""

    kind: str
    prompt: str
    stream: bool

    @property
    def label(self) -> str:
        return f"{self.kind}{' (streamed)' if self.stream else ''}"

    def send(self, base_url: str, max_tokens: int) -> Generation:
        if self.kind == "chat":
            messages = [
                {"role": "system", "content": "answer with the cache block token layer"},
                {"role": "user", "content": self.prompt},
            ]
            return chat(
                base_url,
                messages,
                model=SERVED_MODEL_NAME,
                max_tokens=max_tokens,
                stream=self.stream,
            )
        return complete(
            base_url,
            self.prompt,
            model=SERVED_MODEL_NAME,
            max_tokens=max_tokens,
            stream=self.stream,
        )


def _words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def build_requests(count: int) -> list[RequestSpec]:
    """``count`` requests: the plan in order, then more of its kinds with other lengths.

    Distinct seeds keep prompts from sharing whole blocks, so D never serves one from its own
    prefix cache and every routed request has to pull.
    """
    specs = []
    for index in range(count):
        kind, words, stream = REQUEST_PLAN[index % len(REQUEST_PLAN)]
        if index >= len(REQUEST_PLAN):
            words = 30 + (index * 97) % (MAX_PROMPT_WORDS - 30)
        specs.append(RequestSpec(kind, _words(1000 + index, words), stream))
    return specs


def warmup_request() -> RequestSpec:
    return RequestSpec("completion", _words(999, 40), False)


@dataclass
class TransferDelta:
    """What D's metrics gained across one routed request."""

    pulls: int
    blocks: int
    bytes: int
    pull_s: float
    kv_ready_s: float
    failed: int
    external_tokens: int
    sync_loads: int = 0  # of the pulls, those that landed in the step computing the first token

    @property
    def gbps(self) -> float:
        return self.bytes / self.pull_s / 1e9 if self.pull_s > 0 else 0.0


def decode_snapshot(decode_url: str) -> dict[str, float]:
    samples = read_metrics(decode_url)
    return {
        key: metric_total(samples, name, **labels)
        for key, (name, labels) in _DECODE_METRICS.items()
    }


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> TransferDelta:
    diff = {key: after[key] - before[key] for key in before}
    return TransferDelta(
        pulls=round(diff["pulls"]),
        blocks=round(diff["blocks"]),
        bytes=round(diff["bytes"]),
        pull_s=diff["pull_s"],
        kv_ready_s=diff["kv_ready_s"],
        failed=round(diff["failed_pulls"] + diff["failed_handshakes"]),
        external_tokens=round(diff["external_tokens"]),
        sync_loads=round(diff["sync_loads"]),
    )


def wait_transfer(decode_url: str, before: Mapping[str, float]) -> TransferDelta:
    """D's metric change since ``before``, once a pull (or a failed one) shows up.

    Transfer stats reach D's API server a scheduler step after the pull, so poll, bounded;
    a request that never pulled comes back with zero pulls.
    """
    deadline = time.monotonic() + STATS_WAIT_S
    while True:
        delta = _delta(before, decode_snapshot(decode_url))
        if delta.pulls + delta.failed > 0 or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


@dataclass
class RequestResult:
    """One request through the router beside the same request on the plain server."""

    spec: RequestSpec
    routed: Generation
    plain: Generation
    transfer: TransferDelta

    @property
    def identical(self) -> bool:
        return self.routed.token_ids == self.plain.token_ids and bool(self.plain.token_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.plain.prompt_token_ids or [])


def run_request(
    spec: RequestSpec, router_url: str, plain_url: str, decode_url: str, max_tokens: int
) -> RequestResult:
    plain = spec.send(plain_url, max_tokens)
    before = decode_snapshot(decode_url)
    routed = spec.send(router_url, max_tokens)
    return RequestResult(spec, routed, plain, wait_transfer(decode_url, before))
