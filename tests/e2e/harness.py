"""Building blocks for end-to-end tests with real vLLM servers and the real vLLM router.

The fixtures in ``conftest.py`` wrap these; tests may also call them directly.
- ``ProcessRegistry`` remembers every process a session started, to print their logs on failure.
- ``PDLauncher`` starts one prefill and one decode server (pinned to different cores) with the
  given ``kv_transfer_config`` dicts, plus the router in PD mode, and stops them all.
- ``e2e_prompts``/``CHAT_MESSAGES``: deterministic prompts spanning several 32-token blocks.
- ``example_connector_config``/``hixl_connector_config``: ready ``kv_transfer_config`` dicts.
- ``tiny_model_or_skip``: the tiny model for a session, or a skip without vLLM and the router.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hixl_test_connector import with_controls

from hixl_connector.tools.demo.client import (
    Generation,
    RequestFailed,
    complete,
    metric_total,
    read_metrics,
)
from hixl_connector.tools.demo.processes import ManagedProcess, free_port_range
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    RouterProcess,
    VllmServer,
    start_router,
    start_vllm_server,
)
from hixl_connector.tools.demo.tiny_model import WORDS, build_tiny_model

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
BLOCK_SIZE = 32
MAX_TOKENS = 32
# Word counts give prompts of roughly 70-250 tokens: several full blocks each.
PROMPT_WORD_COUNTS = (72, 120, 170, 230)
CHAT_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "answer with the cache block token layer of the model"},
    {"role": "user", "content": " ".join(random.Random(7).choice(WORDS) for _ in range(90))},
)


# Lengths in tokens: sub-block, exact multiples, k * block_size + 1, and several blocks.
PROMPT_LENGTHS = (5, 32, 33, 64, 65, 97, 129, 160, 230, 300)
# fp32 tiny model: per block and layer, 2 KV heads x 32 tokens x (2 x 32 head dims) x 4 bytes.
BLOCK_BYTES_PER_LAYER = 2 * BLOCK_SIZE * 64 * 4
NUM_LAYERS = 2


# What serving the tiny model takes besides this package: without any of them, no suite that
# starts servers can run.
SERVING_STACK = ("vllm", "transformers", "vllm_router")


def tiny_model_or_skip(tmp_path_factory: pytest.TempPathFactory, suite: str, folder: str) -> Path:
    """The tiny random Llama, built into a fresh temporary ``folder``; skips the ``suite``'s
    tests where the serving stack is not installed. Session fixtures of the end-to-end and the
    fault suites (tests/faults/conftest.py) build their model with it."""
    for module in SERVING_STACK:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{suite} tests need {module!r} (install the cpu and dev extras)")
    return build_tiny_model(tmp_path_factory.mktemp(folder) / "model")


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 450) for _ in range(length)]  # 0..2 are special tokens


PROMPTS = {n: token_prompt(n, seed=n) for n in PROMPT_LENGTHS}


def pulled(server: VllmServer) -> tuple[float, float, float]:
    """(pulls, blocks, bytes) a decode server reports, summed over its ranks."""
    samples = read_metrics(server.url)
    return (
        metric_total(samples, "vllm:hixl_pulls_total"),
        metric_total(samples, "vllm:hixl_pull_blocks_total"),
        metric_total(samples, "vllm:hixl_pull_bytes_total"),
    )


def settled(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 10.0) -> T:
    """Reads until ``done`` holds or the timeout passes; returns the last reading. Metrics
    reach the API server a step after the event they count."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = read()
        if done(current) or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


def wait_for_pulls(server: VllmServer, at_least: float, timeout_s: float = 10.0) -> tuple:
    return settled(lambda: pulled(server), lambda now: now[0] >= at_least, timeout_s)


def request_fails(url: str, prompt: str, **request: Any) -> bool:
    """True when a completion sent to ``url`` fails: an error finish or an HTTP error."""
    try:
        out = complete(url, prompt, model=SERVED_MODEL_NAME, max_tokens=4, **request)
    except RequestFailed:
        return True
    return out.finish_reason == "error"


def hixl_counter(server: VllmServer, name: str) -> float:
    return metric_total(read_metrics(server.url), f"vllm:hixl_{name}_total")


def sync_load_requests(server: VllmServer, tp_size: int = 1) -> float:
    """Requests whose KV a decode server read in the step that computed their first token
    (every rank counts its own read). Such a read leaves the last prompt token to that step's
    forward, so vLLM counts one prompt token less as loaded through the connector."""
    return hixl_counter(server, "sync_loads") / tp_size


def wait_for_counter(server: VllmServer, name: str, at_least: float) -> float:
    return settled(lambda: hixl_counter(server, name), lambda value: value >= at_least)


def generate_all(url: str, lengths: Sequence[int], timeout_s: float) -> dict[int, Generation]:
    """The ``PROMPTS`` of ``lengths`` sent at once, so peers and engines are used
    concurrently; each must finish within ``timeout_s``."""
    with ThreadPoolExecutor(len(lengths)) as pool:
        futures = {
            n: pool.submit(
                complete,
                url,
                PROMPTS[n],
                model=SERVED_MODEL_NAME,
                max_tokens=MAX_TOKENS,
                timeout_s=timeout_s,
            )
            for n in lengths
        }
        return {n: future.result(timeout=timeout_s) for n, future in futures.items()}


def wait_kv_idle(server: VllmServer) -> None:
    """P frees a request's blocks once every D rank that read them said done."""
    usage = settled(
        lambda: metric_total(read_metrics(server.url), "vllm:kv_cache_usage_perc"),
        lambda value: value == 0.0,
    )
    assert usage == 0.0, f"{server.name} still holds KV blocks"


def make_prompt(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def e2e_prompts() -> list[str]:
    return [make_prompt(100 + i, n) for i, n in enumerate(PROMPT_WORD_COUNTS)]


def risky_prompt_length(n_tokens: int, block_size: int = BLOCK_SIZE) -> bool:
    """True for lengths where ExampleConnector's producer and consumer round differently.

    The producer stores ``(n-1)//bs*bs`` tokens but the consumer looks up ``(n-2)//bs*bs``,
    so at ``n % bs == 1`` the consumer misses and silently recomputes.
    """
    return n_tokens % block_size == 1


def external_prompt_tokens(server_url: str) -> float:
    """Prompt tokens a server has loaded through its KV connector instead of computing them.

    vLLM counts them for any connector (from ``get_num_new_matched_tokens``), so a rise
    across a request proves that D used transferred KV rather than silently recomputing.
    """
    samples = read_metrics(server_url)
    return metric_total(
        samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )


def every_prompt_pulled(
    url: str,
    decode: VllmServer,
    plain_outputs: Mapping[Any, Generation],
    *,
    decode_ranks: int = 1,
    decode_block_size: int = BLOCK_SIZE,
) -> float:
    """Sends each of ``PROMPTS`` through ``url`` in turn and asserts, for each, that the output
    is token-identical to the plain run and that ``decode`` pulled exactly the prompt's KV:
    one pull per D rank, the prompt's D blocks on every rank, and P's blocks of the prompt
    for the whole model in bytes (a last D block the prompt ends in the first half of takes
    one P block, not two). Last, vLLM's own count of prompt tokens that came from the
    connector: all of them but the last of a read in the step, which that step's forward
    computes. Returns how many requests D read in the step."""
    pulls, blocks, nbytes = pulled(decode)
    external = external_prompt_tokens(decode.url)
    sync_before = sync_load_requests(decode, decode_ranks)
    for n, prompt in PROMPTS.items():
        out = complete(url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        assert out.token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
        assert out.prompt_token_ids == prompt
        now = wait_for_pulls(decode, pulls + decode_ranks)
        assert now[0] - pulls == decode_ranks, f"{n}-token prompt: {now[0] - pulls} pulls"
        assert now[1] - blocks == math.ceil(n / decode_block_size) * decode_ranks
        assert now[2] - nbytes == math.ceil(n / BLOCK_SIZE) * NUM_LAYERS * BLOCK_BYTES_PER_LAYER
        pulls, blocks, nbytes = now

    def loaded_and_read_in_step() -> tuple[float, float]:
        return (
            external_prompt_tokens(decode.url) - external,
            sync_load_requests(decode, decode_ranks) - sync_before,
        )

    expected = sum(PROMPT_LENGTHS)
    loaded, read_synchronously = settled(
        loaded_and_read_in_step, lambda now: now[0] == expected - now[1]
    )
    assert loaded == expected - read_synchronously
    return read_synchronously


def example_connector_config(storage_dir: str | Path) -> dict[str, Any]:
    """vLLM's built-in disk connector: P writes KV files, D reads them (plumbing check only)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


def hixl_connector_config(role: str, ranks: int = 1, **extra: Any) -> dict[str, Any]:
    """``configs/<role>.json`` ("prefill" or "decode") with free side-channel ports for
    ``ranks`` TP ranks; with a test control among ``extra``, for the test-only connector.

    ``extra`` overrides keys of ``kv_connector_extra_config``.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    config = json.loads((CONFIG_DIR / f"{role}.json").read_text())
    extra_config = dict(config.get("kv_connector_extra_config", {}))
    extra_config["side_channel_port"] = free_port_range(ranks)
    extra_config.update(extra)
    config["kv_connector_extra_config"] = extra_config
    return with_controls(config)


class ProcessRegistry:
    """Every process started in a session, for log reports when a test fails."""

    def __init__(self) -> None:
        self._processes: list[ManagedProcess] = []
        self._lock = threading.Lock()

    def add(self, process: ManagedProcess) -> None:
        with self._lock:
            self._processes.append(process)

    def log_report(self, lines: int = 40) -> str:
        with self._lock:
            processes = list(self._processes)
        return "\n\n".join(
            f"===== {p.name} (pid {p.pid}, alive {p.alive()}, log {p.log_path}) =====\n"
            f"{p.log_tail(lines)}"
            for p in processes
        )


@dataclass
class PDDeployment:
    """One prefill and one decode server, and the router in front of them (if started)."""

    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess | None
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError("this deployment was started without a router")
        return self.router.url

    def processes(self) -> list[ManagedProcess]:
        found: list[ManagedProcess] = [self.prefill, self.decode]
        if self.router is not None:
            found.append(self.router)
        return found


# A router's P (or several, by name) and D, by name.
Pair = tuple[str | tuple[str, ...], str]


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else names


@dataclass
class NamedFleet:
    """Servers by name, and a router per named P/D pair of them (PDLauncher.pairs)."""

    servers: dict[str, VllmServer]
    routers: dict[str, RouterProcess]


class PDLauncher:
    """Starts P/D deployments with given ``kv_transfer_config`` dicts; ``stop_all`` ends them,
    as does leaving a ``with`` block over the launcher."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        registry: ProcessRegistry,
        health_timeout_s: float = 300.0,
    ) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.registry = registry
        self.health_timeout_s = health_timeout_s
        self._started: list[ManagedProcess] = []
        self._count = 0

    def _track(self, process: ManagedProcess) -> None:
        self._started.append(process)
        self.registry.add(process)

    def start(
        self,
        prefill_config: Mapping[str, Any] | None,
        decode_config: Mapping[str, Any] | None,
        *,
        with_router: bool = True,
        prefill_env: Mapping[str, str] | None = None,
        decode_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> PDDeployment:
        """Start P (core 0) and D (core 1) together, wait for both, then the router."""
        self._count += 1
        run_dir = self.log_dir / f"pd{self._count}"
        prefill = self.server(
            "prefill", prefill_config, core=0, args=extra_args, env=prefill_env, log_dir=run_dir
        )
        decode = self.server(
            "decode", decode_config, core=1, args=extra_args, env=decode_env, log_dir=run_dir
        )
        deployment = PDDeployment(prefill, decode, None)
        deployment.timings_s["prefill_healthy"] = prefill.wait_healthy(self.health_timeout_s)
        deployment.timings_s["decode_healthy"] = decode.wait_healthy(self.health_timeout_s)
        if with_router:
            router = start_router([prefill.url], [decode.url], run_dir)
            self._track(router)
            deployment.router = router
            deployment.timings_s["router_healthy"] = router.wait_healthy(60.0)
        return deployment

    __call__ = start

    def server(
        self,
        name: str,
        config: Mapping[str, Any] | None,
        *,
        tp: int = 1,
        dp: int = 1,
        core: int | None = None,
        args: Sequence[str] = (),
        model_dir: Path | None = None,
        block_size: int = BLOCK_SIZE,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> VllmServer:
        """Starts one server (not yet healthy), its log in ``log_dir`` (by default a folder
        ``name`` of the launcher's log folder). TP > 1 runs one worker per core, each bound
        by vLLM (``VLLM_CPU_OMP_THREADS_BIND``) instead of ``taskset``, at a lower priority
        once healthy: its engine and workers talk through vLLM's shared-memory queues, whose
        readers spin while a step is under way, and they step without pause while KV sends
        or receives are pending, which on a 2-core host starves the peer they wait for.
        DP > 1 runs each engine's model in its engine process (``uni``), as a one-engine
        server does: with a worker process of their own, two DP engines holding leases
        starved everything else (the kernel reported its own workqueues stuck for 36 s)
        until the leases ran out."""
        env = dict(env or {})
        extra = list(args)
        nice = 0
        if dp > 1:
            extra += ["--data-parallel-size", str(dp)]
            if tp == 1:
                extra += ["--distributed-executor-backend", "uni"]
        if tp > 1:
            nice = 10
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(cores[i % len(cores)]) for i in range(tp)
            )
            extra += ["--tensor-parallel-size", str(tp)]
            core = None
        server = start_vllm_server(
            model_dir or self.model_dir,
            log_dir or self.log_dir / name,
            name,
            core=core,
            kv_transfer_config=config,
            block_size=block_size,
            extra_env=env,
            extra_args=extra,
            nice=nice,
        )
        self._track(server)
        return server

    def router(
        self, name: str, prefills: Sequence[VllmServer], decodes: Sequence[VllmServer]
    ) -> RouterProcess:
        """Starts the router in front of healthy servers and waits until it is healthy."""
        router = start_router(
            [p.url for p in prefills], [d.url for d in decodes], self.log_dir / name
        )
        self._track(router)
        router.wait_healthy(60.0)
        return router

    def pairs(
        self, servers: Mapping[str, VllmServer], pairs: Mapping[str, Pair]
    ) -> dict[str, RouterProcess]:
        """Waits until every server is healthy, then a router per named (P, D) pair."""
        for server in servers.values():
            server.wait_healthy(self.health_timeout_s)
        return {
            name: self.router(f"router_{name}", [servers[n] for n in _names(p)], [servers[d]])
            for name, (p, d) in pairs.items()
        }

    def stop_all(self) -> None:
        # Router first, so no request reaches a server that is going away.
        for process in reversed(self._started):
            process.stop()
        self._started.clear()

    def __enter__(self) -> PDLauncher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()
