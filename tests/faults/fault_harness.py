"""Building blocks of the fault matrix: restartable P/D servers, the two request legs, and
measurements taken from vLLM's own accounting (its KV-cache usage gauge).

The tests drive the two legs themselves (what a P/D router does: P with ``max_tokens=1`` and
the remote-decode marker, then D with P's ``kv_transfer_params``), so that a case can act
between the legs: kill or freeze P, cut the link, forge the params, or skip D.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness import hixl_counter, token_prompt

from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    Generation,
    RequestFailed,
    complete,
    metric_total,
    read_metrics,
)
from hixl_connector.tools.demo.processes import ProcessFailed, free_port, visit_process_group
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    VllmServer,
    vllm_server_argv,
    vllm_server_env,
)
from hixl_connector.tools.netns import NetnsBed

from .deployments import IDLE_TIMEOUT_S

HEALTH_TIMEOUT_S = 300.0
MAX_TOKENS = 16


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05
) -> float:
    """Polls until ``predicate()``; returns the seconds it took, raises after ``timeout_s``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not reached within {timeout_s:.1f} s")
        time.sleep(poll_s)


def kv_usage(server: VllmServer) -> float:
    """vLLM's own fraction of KV blocks in use (prefix-cached free blocks count as free)."""
    return metric_total(read_metrics(server.url), "vllm:kv_cache_usage_perc")


def requests_in_flight(server: VllmServer) -> float:
    samples = read_metrics(server.url)
    return metric_total(samples, "vllm:num_requests_running") + metric_total(
        samples, "vllm:num_requests_waiting"
    )


def wait_idle(server: VllmServer, timeout_s: float = IDLE_TIMEOUT_S) -> float:
    """Seconds until vLLM reports no KV block in use and no request in flight."""
    return wait_for(
        lambda: kv_usage(server) == 0.0 and requests_in_flight(server) == 0.0,
        timeout_s,
        f"{server.name} KV usage back to idle",
    )


def leftover(*servers: VllmServer) -> str:
    """What vLLM still holds, in its own words (KV usage gauge and request gauges)."""
    parts = []
    for server in servers:
        if not server.alive():
            parts.append(f"{server.name}: process gone")
            continue
        usage, busy = kv_usage(server), requests_in_flight(server)
        parts.append(f"{server.name}: KV usage {usage:.1%}, {busy:.0f} requests")
    return "; ".join(parts)


def prefill_leg(
    server: VllmServer, prompt: Sequence[int], timeout_s: float = 60.0
) -> dict[str, Any]:
    """P's leg: one token, blocks kept under a lease; returns the params for D."""
    out = complete(
        server.url,
        list(prompt),
        model=SERVED_MODEL_NAME,
        max_tokens=1,
        extra={"kv_transfer_params": dict(PREFILL_LEG_PARAMS)},
        timeout_s=timeout_s,
    )
    if not out.kv_transfer_params:
        raise AssertionError(f"prefill returned no kv_transfer_params: {out.raw!r:.500}")
    return out.kv_transfer_params


def decode_leg(
    server: VllmServer,
    prompt: Sequence[int],
    params: Mapping[str, Any],
    timeout_s: float = 60.0,
    max_tokens: int = MAX_TOKENS,
) -> Generation:
    return complete(
        server.url,
        list(prompt),
        model=SERVED_MODEL_NAME,
        max_tokens=max_tokens,
        extra={"kv_transfer_params": dict(params)},
        timeout_s=timeout_s,
    )


def plain(server: VllmServer, prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """The reference: the same model computing the whole request itself."""
    return complete(
        server.url, list(prompt), model=SERVED_MODEL_NAME, max_tokens=max_tokens
    ).token_ids


@dataclass
class LegResult:
    """The outcome of a decode leg: tokens, or the error a client saw, and when it came."""

    tokens: list[int] | None
    error: str | None
    finished_at: float

    @property
    def failed(self) -> bool:
        return self.error is not None


def run_decode(
    server: VllmServer, prompt: Sequence[int], params: Mapping[str, Any], timeout_s: float
) -> LegResult:
    try:
        out = decode_leg(server, prompt, params, timeout_s=timeout_s)
    except RequestFailed as e:
        return LegResult(None, str(e), time.monotonic())
    if out.finish_reason == "error":
        return LegResult(out.token_ids, "finish_reason=error", time.monotonic())
    return LegResult(out.token_ids, None, time.monotonic())


def two_legs_identical(pd: Servers, seed: int, length: int = 150) -> None:
    """P's leg, then D's with P's params: D's tokens are the plain run's."""
    prompt = token_prompt(length, seed)
    expected = plain(pd["prefill"], prompt)
    result = run_decode(pd["decode"], prompt, prefill_leg(pd["prefill"], prompt), 60.0)
    assert result.error is None, result.error
    assert result.tokens == expected


def both_idle(pd: Servers, timeout_s: float = IDLE_TIMEOUT_S) -> str:
    """Waits until P and D hold no KV block and no request; returns what is left over."""
    wait_idle(pd["prefill"], timeout_s)
    wait_idle(pd["decode"], timeout_s)
    return leftover(pd["prefill"], pd["decode"])


class Servers:
    """P and D vLLM servers that a test may kill, freeze and restart on the same ports; leaving
    a ``with`` block over them stops them all."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        configs: Mapping[str, Mapping[str, Any]],
        extra_args: Mapping[str, Sequence[str]] | None = None,
        wrap: Mapping[str, Sequence[str]] | None = None,
        http_hosts: Mapping[str, str] | None = None,
    ) -> None:
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._configs = dict(configs)
        self._extra_args = dict(extra_args or {})
        self._wrap = dict(wrap or {})
        self._http_hosts = dict(http_hosts or {})
        self._servers: dict[str, VllmServer] = {}
        self._starts = 0

    def __getitem__(self, name: str) -> VllmServer:
        return self._servers[name]

    def start(self, *names: str, ports: Mapping[str, int] | None = None) -> float:
        """Starts the named servers together; returns seconds until all are healthy.

        P runs on core 0 and D on core 1 (names starting with "p" are prefill servers).
        """
        began = time.monotonic()
        for name in names:
            self._starts += 1
            port = (ports or {}).get(name) or free_port()
            extra_args = [*self._extra_args.get(name, ()), *self._host_args(name)]
            argv = vllm_server_argv(
                self._model_dir,
                port,
                core=0 if name.startswith("p") else 1,
                kv_transfer_config=self._configs[name],
                extra_args=extra_args,
            )
            server = VllmServer(
                name,
                [*self._wrap.get(name, ()), *argv],
                self._log_dir / f"{name}{self._starts}.log",
                port,
                vllm_server_env(extra_args),
            )
            if name in self._http_hosts:
                server.url = f"http://{self._http_hosts[name]}:{port}"
            server.start()
            self._servers[name] = server
        for name in names:
            self._servers[name].wait_healthy(HEALTH_TIMEOUT_S)
        return time.monotonic() - began

    def config(self, name: str) -> dict[str, Any]:
        """The kv_connector_extra_config the named server runs with."""
        return dict(self._configs[name]["kv_connector_extra_config"])

    def _host_args(self, name: str) -> list[str]:
        # A later --host wins over the default 127.0.0.1 (argparse keeps the last value).
        return ["--host", self._http_hosts[name]] if name in self._http_hosts else []

    def restart(self, name: str, engine_id: str | None = None) -> float:
        """Stops the server and starts it on the same port, under ``engine_id`` if given."""
        old = self._servers[name]
        old.stop()
        if engine_id is not None:
            self._configs[name] = {**self._configs[name], "engine_id": engine_id}
        return self.start(name, ports={name: old.port})

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signals the server's whole process group: API server and EngineCore alike."""
        pid = self._servers[name].pid
        assert pid is not None
        os.killpg(pid, sig)

    def wait_gone(self, name: str, timeout_s: float = 10.0) -> None:
        """Until no process of the server's group runs (SIGKILL is delivered asynchronously;
        a zombie has no memory left to read)."""
        pgid = self._servers[name].pid
        assert pgid is not None

        def state(proc: Path) -> str:
            return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]

        def running() -> bool:
            return any(s != "Z" for s in visit_process_group(pgid, state).values())

        wait_for(lambda: not running(), timeout_s, f"{name}'s processes gone")

    def stop_all(self) -> None:
        for server in self._servers.values():
            if server.pid is not None:
                try:
                    os.killpg(server.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            server.stop(grace_s=5.0)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(
            f"===== {s.name} =====\n{s.log_tail(lines)}" for s in self._servers.values()
        )


@dataclass
class FaultReport:
    """Rows of the reliability table, as the tests measured them; saved as JSON."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    def record(
        self, case: str, outcome: str, detected_s: float | None, leftover: str, **extra: Any
    ) -> None:
        row = {
            "case": case,
            "outcome": outcome,
            "detected_s": None if detected_s is None else round(detected_s, 3),
            "leftover": leftover,
            **extra,
        }
        self.rows = [r for r in self.rows if r["case"] != case] + [row]
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"cases": self.rows}, indent=2) + "\n")


__all__ = [
    "FaultReport",
    "LegResult",
    "ProcessFailed",
    "Servers",
    "decode_leg",
    "hixl_counter",
    "kv_usage",
    "leftover",
    "plain",
    "prefill_leg",
    "run_decode",
    "token_prompt",
    "wait_for",
    "wait_idle",
]


def in_namespaces(
    model_dir: Path,
    log_dir: Path,
    configs: dict[str, dict[str, Any]],
    net: NetnsBed,
    extra_args: Mapping[str, Sequence[str]] | None = None,
) -> Servers:
    """P and D servers each in its own namespace of ``net``: side channel and engine on the
    data link's addresses, HTTP on the management links."""
    for role, ip in (("prefill", net.p_ip), ("decode", net.d_ip)):
        configs[role]["kv_connector_extra_config"].update(side_channel_host=ip, engine_host=ip)
    return Servers(
        model_dir,
        log_dir,
        configs,
        extra_args,
        wrap={"prefill": net.exec_prefix(net.ns_p), "decode": net.exec_prefix(net.ns_d)},
        http_hosts={"prefill": net.p_http, "decode": net.d_http},
    )
