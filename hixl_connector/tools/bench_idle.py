"""``python -m hixl_connector bench-idle``: what a decode server waiting for KV costs in CPU,
push mode beside pull mode and a plain vLLM server, in the same run.

A plain server and two P/D pairs with hixl_connector, one in push mode and one in pull mode,
run at once on the tiny model (the plain server and the Ps on one core, the Ds on the other,
where the host has two). Windows of ``--window-s`` seconds are taken in turn, ``--rounds``
times: each server idle, then each D while ``--waiting`` requests wait for their KV. In push
mode those are D's legs alone, as vllm-router sends them: D registers their blocks with P,
which never gets the prompts, so nothing is pushed. In pull mode P serves the prompts' legs
and is then frozen (SIGSTOP), so D's reads (over TCP: a same-host read needs no P) wait.
Either way every request waits through the run (D's ``pull_timeout_s`` is set past it). A
server's CPU is the user and system time of every process of its group (API server, engine
core), from /proc, as a share of one core; the median of the rounds is printed.

D's engine steps while requests wait for KV (vLLM's busy loop), so a waiting D costs vLLM's
own empty steps plus the connector's wait between them, which is the same in both modes:
asleep until the reads' handles end (pull) or a peer's write lands (push,
``wait_for_writes``), at most a couple of milliseconds a step.

    python -m hixl_connector bench-idle [--waiting 4] [--window-s 5] [--rounds 3]
                                        [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    RequestFailed,
    metric_total,
    push_identity,
    read_metrics,
    send_leg,
)
from hixl_connector.tools.demo.pd_demo import connector_config
from hixl_connector.tools.demo.processes import signals_as_interrupt, visit_process_group
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    VllmServer,
    start_vllm_server,
)
from hixl_connector.tools.demo.tiny_model import build_tiny_model

HEALTH_TIMEOUT_S = 300.0
# Long enough that no waiting request ends within the run.
WAIT_FOR_KV_S = 600.0
MODES = ("push", "pull")


def group_cpu_s(group: int) -> float:
    """User plus system seconds of every live process in process group ``group``."""

    def cpu_ticks(proc: Path) -> int:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        # After the command: state, ppid, pgrp, ..., utime (index 11), stime (12).
        return int(fields[11]) + int(fields[12])

    return sum(visit_process_group(group, cpu_ticks).values()) / os.sysconf("SC_CLK_TCK")


def cores_used(server: VllmServer, window_s: float) -> float:
    """The share of one core ``server``'s processes used over the next ``window_s``."""
    assert server.pid is not None
    before, began = group_cpu_s(server.pid), time.monotonic()
    time.sleep(window_s)
    return (group_cpu_s(server.pid) - before) / (time.monotonic() - began)


def waiting_requests(decode: VllmServer) -> float:
    samples = read_metrics(decode.url)
    return metric_total(samples, "vllm:num_requests_waiting")


def prefill_leg(prefill: VllmServer, prompt: list[int], request_id: str) -> dict[str, Any]:
    """P's leg of a request: its answer's kv_transfer_params."""
    answer = send_leg(
        prefill.url, prompt, PREFILL_LEG_PARAMS, request_id, model=SERVED_MODEL_NAME, max_tokens=1
    )
    assert answer.kv_transfer_params, "P answered no kv_transfer_params"
    return dict(answer.kv_transfer_params)


def decode_leg(
    decode: VllmServer,
    prompt: list[int],
    params: dict[str, Any],
    request_id: str,
    timeout_s: float = 60.0,
) -> None:
    send_leg(
        decode.url,
        prompt,
        params,
        request_id,
        model=SERVED_MODEL_NAME,
        max_tokens=4,
        timeout_s=timeout_s,
    )


def served_once(pair: tuple[VllmServer, VllmServer]) -> dict[str, Any]:
    """One request's two legs, as the router's first (D links P); P's answer."""
    prefill, decode = pair
    prompt = list(range(3, 103))
    request_id = uuid.uuid4().hex
    params = prefill_leg(prefill, prompt, request_id)
    decode_leg(decode, prompt, push_identity(params) if is_push(params) else params, request_id)
    return params


def is_push(params: dict[str, Any]) -> bool:
    return params.get("transfer_mode") == "push"


def prompt_of(seed: int) -> list[int]:
    return [3 + (seed * 7 + i) % 400 for i in range(160)]


def decode_legs(decode: VllmServer, params: list[dict[str, Any]]) -> None:
    """D legs that wait for their KV until D stops, one thread each."""

    def leg(seed: int, leg_params: dict[str, Any]) -> None:
        try:
            decode_leg(decode, prompt_of(seed), leg_params, uuid.uuid4().hex, WAIT_FOR_KV_S)
        except RequestFailed:
            pass  # D stopped under it at the end of the run

    for seed, leg_params in enumerate(params):
        threading.Thread(target=leg, args=(seed, leg_params), daemon=True).start()
    count = len(params)
    decode.wait_until(
        lambda: waiting_requests(decode) >= count, 60.0, f"{count} requests waiting", poll_s=0.1
    )


def waiting_for_pushes(pair: tuple[VllmServer, VllmServer], count: int) -> None:
    """``count`` D legs whose P legs never come: nothing is pushed."""
    identity = push_identity(served_once(pair))
    decode_legs(pair[1], [dict(identity) for _ in range(count)])


def waiting_for_reads(pair: tuple[VllmServer, VllmServer], count: int) -> None:
    """D linked to P by a first request; P serves ``count`` prompts' legs and is frozen; D's
    reads of them wait."""
    prefill, decode = pair
    served_once(pair)
    params_of_waiting = [
        prefill_leg(prefill, prompt_of(seed), uuid.uuid4().hex) for seed in range(count)
    ]
    assert prefill.pid is not None
    os.killpg(prefill.pid, signal.SIGSTOP)
    decode_legs(decode, params_of_waiting)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector bench-idle")
    parser.add_argument("--waiting", type=int, default=4, help="requests waiting for pushes")
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    with signals_as_interrupt(), tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        model = build_tiny_model(work / "model")
        started: list[VllmServer] = []
        frozen: list[VllmServer] = []
        try:
            plain = start_vllm_server(model, work / "logs", "plain", core=0)
            pairs = {mode: start_pair(model, work, mode) for mode in MODES}
            started += [plain, *(server for pair in pairs.values() for server in pair)]
            for server in started:
                server.wait_healthy(HEALTH_TIMEOUT_S)
            rows: dict[str, list[float]] = {}

            def measure(name: str, server: VllmServer) -> None:
                rows.setdefault(name, []).append(cores_used(server, args.window_s))

            for _ in range(args.rounds):
                measure("plain, idle", plain)
                for mode, (_, decode) in pairs.items():
                    measure(f"D ({mode}), idle", decode)
            waiting_for_pushes(pairs["push"], args.waiting)
            waiting_for_reads(pairs["pull"], args.waiting)
            frozen.append(pairs["pull"][0])
            for _ in range(args.rounds):
                for mode, (_, decode) in pairs.items():
                    measure(f"D ({mode}), {args.waiting} requests waiting for KV", decode)
            print(f"CPU over {args.rounds} windows of {args.window_s:g} s (share of one core)")
            print(f"{'server':44s} {'median':>7s} {'min':>7s} {'max':>7s}")
            for name, values in rows.items():
                median = statistics.median(values)
                print(f"{name:44s} {median:7.3f} {min(values):7.3f} {max(values):7.3f}")
            return 0
        finally:
            for server in frozen:
                if server.pid is not None:
                    os.killpg(server.pid, signal.SIGCONT)
            for server in reversed(started):
                server.stop()


def start_pair(model: Path, work: Path, mode: str) -> tuple[VllmServer, VllmServer]:
    """P (core 0) and D (core 1) in ``mode``, D waiting past the run (started, not healthy)."""
    configs = {role: connector_config(role) for role in ("prefill", "decode")}
    for config in configs.values():
        config["kv_connector_extra_config"]["transfer_mode"] = mode
        if mode == "pull":  # a same-host read would not need the frozen P's server
            config["kv_connector_extra_config"]["transport"] = "tcp"
    configs["decode"]["kv_connector_extra_config"]["pull_timeout_s"] = WAIT_FOR_KV_S
    logs = work / "logs" / mode
    prefill = start_vllm_server(
        model, logs, "prefill", core=0, kv_transfer_config=configs["prefill"]
    )
    decode = start_vllm_server(model, logs, "decode", core=1, kv_transfer_config=configs["decode"])
    return prefill, decode
