"""``python -m hixl_connector demo``: prefill/decode disaggregation with real vLLM, end to end.

Starts a plain vLLM server (the reference), a prefill server (P) and a decode server (D) that
move KV through hixl_connector, and vllm-router in PD mode in front of P and D. Then it sends
the same greedy requests to the plain server and through the router, prints both outputs side
by side with D's transfer figures, and exits 0 only if every output is token-identical and D
really pulled the KV (no silent recompute). Everything it starts is stopped on the way out,
also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hixl_connector.tools.demo.client import RequestFailed
from hixl_connector.tools.demo.pd_report import ms, request_lines, summarize
from hixl_connector.tools.demo.pd_workload import (
    RequestResult,
    build_requests,
    decode_snapshot,
    run_request,
    wait_transfer,
    warmup_request,
)
from hixl_connector.tools.demo.processes import (
    ManagedProcess,
    ProcessFailed,
    free_port,
    http_ok,
    signals_as_interrupt,
    visit_process_group,
)
from hixl_connector.tools.demo.servers import (
    RouterProcess,
    VllmServer,
    start_router,
    start_vllm_server,
)
from hixl_connector.tools.demo.tiny_model import build_tiny_model, is_built

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
DEFAULT_WORK_DIR = "artifacts/demo"
HEALTH_TIMEOUT_S = 300.0
PREFILL_CORE, DECODE_CORE = 0, 1  # indices into the CPUs this process may use
HEARTBEAT_S = 10.0
STOP_GRACE_S = 5.0  # a healthy vLLM server exits within about 1 s of SIGTERM
LOG_TAIL_LINES = 30
# A raised exception, bare or in a vLLM "(Proc pid=N) ERROR ... [file:line]" log line.
_ERROR_LINE = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?[\w.]*(?:Error|Exception): .*$", re.MULTILINE)
EXIT_MISMATCH, EXIT_ERROR, EXIT_INTERRUPTED = 1, 2, 130


class DemoError(RuntimeError):
    """A problem the user can fix (missing dependency, missing file)."""


class Progress:
    """Prints lines stamped with the seconds since the demo started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)


@dataclass
class DemoStack:
    """Every process the demo started, so that all of them are stopped whatever happens."""

    plain: VllmServer | None = None
    prefill: VllmServer | None = None
    decode: VllmServer | None = None
    router: RouterProcess | None = None
    processes: list[ManagedProcess] = field(default_factory=list)
    exited_early: set[str] = field(default_factory=set)

    def urls(self) -> tuple[str, str, str]:
        """(router, plain, decode) URLs; only valid once everything is healthy."""
        if self.router is None or self.plain is None or self.decode is None:
            raise DemoError("the servers are not running")
        return self.router.url, self.plain.url, self.decode.url

    def stop(self) -> None:
        self.exited_early = {p.name for p in self.processes if not p.alive()}
        # In parallel: each stop may wait out a grace period.
        with ThreadPoolExecutor(max(1, len(self.processes))) as pool:
            list(pool.map(lambda process: process.stop(grace_s=STOP_GRACE_S), self.processes))

    def log_report(self) -> list[str]:
        lines = []
        for process in self.processes:
            lines.append(
                f"----- {process.name} (rc {process.returncode}), log {process.log_path}, "
                f"last {LOG_TAIL_LINES} lines -----"
            )
            lines.append(process.log_tail(LOG_TAIL_LINES))
            # The tail is often a long chain of re-raises; the first error names the cause.
            first = _first_error(process.log_path) if process.name in self.exited_early else None
            if first:
                lines.append(f"----- {process.name}: first error in the log -----\n{first}")
        return lines


def _first_error(log_path: Path) -> str | None:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    match = _ERROR_LINE.search(text)
    return match.group(0).strip() if match else None


def check_environment() -> None:
    missing = [
        name
        for name in ("vllm", "vllm_router", "transformers", "hixl_connector._native")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise DemoError(
            f"missing: {', '.join(missing)}. Run `bash .ci/setup` (or `bash .ci/demo`, which "
            "does it first) and use .venv/bin/python."
        )
    if not CONFIG_DIR.is_dir():
        raise DemoError(f"{CONFIG_DIR} not found: run the demo from a source checkout")


def connector_config(role: str) -> dict[str, Any]:
    """``configs/<role>.json`` with a free side-channel port, so demos never clash."""
    config: dict[str, Any] = json.loads((CONFIG_DIR / f"{role}.json").read_text())
    extra = dict(config.get("kv_connector_extra_config", {}))
    extra["side_channel_host"] = "127.0.0.1"
    extra["side_channel_port"] = free_port()
    config["kv_connector_extra_config"] = extra
    return config


def pin_to_core(process: ManagedProcess, core_index: int) -> None:
    """Move every thread of ``process``'s group onto one core, as ``taskset`` would at start.

    The plain server starts unpinned, so the three start-ups share both cores, then joins D's
    core: its latencies are then measured on the same core as D's, like for like.
    """
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[core_index % len(allowed)]

    def pin(proc: Path) -> None:
        for task in (proc / "task").iterdir():
            os.sched_setaffinity(int(task.name), {core})

    if process.pid is not None:
        visit_process_group(process.pid, pin)


def prepare_model(model_dir: Path, say: Progress) -> Path:
    if is_built(model_dir):
        say(f"tiny model: cached in {model_dir}")
        return model_dir
    say(f"building the tiny model (random Llama, 411k parameters) into {model_dir} ...")
    started = time.monotonic()
    build_tiny_model(model_dir)
    say(f"tiny model built in {time.monotonic() - started:.1f} s")
    return model_dir


def start_stack(stack: DemoStack, model_dir: Path, log_dir: Path, say: Progress) -> None:
    """Start plain, P and D together and the router once P and D answer; wait for all four."""
    say(
        "starting the plain server, prefill server (P) and decode server (D), one core each for "
        "P and D, all together ..."
    )

    def start(role: str, core: int | None = None) -> VllmServer:
        config = None if role == "plain" else connector_config(role)
        server = start_vllm_server(model_dir, log_dir, role, core=core, kv_transfer_config=config)
        stack.processes.append(server)
        return server

    stack.plain = start("plain")
    stack.prefill = start("prefill", PREFILL_CORE)
    stack.decode = start("decode", DECODE_CORE)
    labels: dict[ManagedProcess, str] = {
        stack.plain: "plain reference server (now on D's core)",
        stack.prefill: "prefill server (P, kv_producer)",
        stack.decode: "decode server (D, kv_consumer)",
    }
    pending: list[VllmServer | RouterProcess] = [stack.plain, stack.prefill, stack.decode]
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    heartbeat = time.monotonic() + HEARTBEAT_S
    while pending:
        for process in list(pending):
            if not process.alive():
                raise ProcessFailed(f"{process.name} exited with rc {process.returncode}")
            if http_ok(process.url + "/health", timeout_s=1.0):
                process.healthy_after_s = time.monotonic() - process.started_at
                say(f"{labels[process]} healthy in {process.healthy_after_s:.1f} s, {process.url}")
                pending.remove(process)
                if process is stack.plain:
                    pin_to_core(process, DECODE_CORE)
        if stack.router is None and stack.prefill not in pending and stack.decode not in pending:
            say("starting vllm-router (PD mode) in front of P and D ...")
            stack.router = start_router([stack.prefill.url], [stack.decode.url], log_dir)
            stack.processes.append(stack.router)
            labels[stack.router] = "vllm-router"
            pending.append(stack.router)
        now = time.monotonic()
        if pending and now > deadline:
            names = ", ".join(p.name for p in pending)
            raise ProcessFailed(f"not healthy within {HEALTH_TIMEOUT_S:.0f} s: {names}")
        if pending and now > heartbeat:
            say("  still starting: " + ", ".join(p.name for p in pending))
            heartbeat = now + HEARTBEAT_S
        time.sleep(0.25)


def exercise(stack: DemoStack, prompts: int, max_tokens: int, say: Progress) -> list[RequestResult]:
    router_url, plain_url, decode_url = stack.urls()
    warmup = warmup_request()
    say("warm-up request on both paths (not counted; D connects to P for the first time) ...")
    plain = warmup.send(plain_url, max_tokens)
    before = decode_snapshot(decode_url)
    routed = warmup.send(router_url, max_tokens)
    delta = wait_transfer(decode_url, before)
    ready = ms(delta.kv_ready_s / delta.pulls) if delta.pulls else "n/a (nothing pulled)"
    say(
        f"warm-up: {routed.latency_s:.3f} s through the router, {plain.latency_s:.3f} s plain, "
        f"KV ready on D {ready}"
    )
    specs = build_requests(prompts)
    say(
        f"{len(specs)} requests, each to the plain server and through the router, greedy, "
        f"max_tokens={max_tokens} (random weights: the text is gibberish; what counts is that "
        "both agree token for token):"
    )
    results = []
    for index, spec in enumerate(specs, start=1):
        result = run_request(spec, router_url, plain_url, decode_url, max_tokens)
        print("\n".join(request_lines(index, len(specs), result)), flush=True)
        results.append(result)
    return results


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Shutdown must finish even if the user presses Ctrl-C again."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    say = Progress()
    work_dir = Path(args.work_dir).resolve()
    log_dir = work_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    say(f"hixl_connector P/D demo: work dir {work_dir}, logs in {log_dir}")
    stack = DemoStack()
    outcome = "failed"
    code = EXIT_ERROR
    with signals_as_interrupt():
        try:
            check_environment()
            model_dir = prepare_model(work_dir / "model", say)
            start_stack(stack, model_dir, log_dir, say)
            results = exercise(stack, args.prompts, args.max_tokens, say)
            verdict = summarize(results)
            print("\n".join(verdict.lines), flush=True)
            outcome, code = ("passed", 0) if verdict.ok else ("failed", EXIT_MISMATCH)
        except KeyboardInterrupt:
            outcome, code = "interrupted", EXIT_INTERRUPTED
            say("interrupted")
        except (DemoError, ProcessFailed, RequestFailed, OSError, ValueError) as exc:
            say(f"error: {exc}")
        finally:
            with signals_ignored():
                _shut_down(stack, log_dir, outcome, args.keep_logs, say)
    return code


def _shut_down(
    stack: DemoStack, log_dir: Path, outcome: str, keep_logs: bool, say: Callable[[str], None]
) -> None:
    if stack.processes:
        say(f"stopping {len(stack.processes)} processes ...")
        stack.stop()
        say("all stopped")
    if outcome == "failed" and stack.processes:
        print("\n".join(stack.log_report()), file=sys.stderr, flush=True)
    if outcome == "passed" and not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif log_dir.exists():
        say(f"logs kept in {log_dir}: " + ", ".join(p.log_path.name for p in stack.processes))


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hixl_connector demo",
        description="Prefill/decode disaggregation with real vLLM servers, vllm-router and "
        "hixl_connector, checked token for token against a plain vLLM server.",
    )
    parser.add_argument(
        "--work-dir",
        default=DEFAULT_WORK_DIR,
        help=f"model cache and logs (default: {DEFAULT_WORK_DIR})",
    )
    parser.add_argument(
        "--prompts", type=_bounded_int(1, 50), default=6, help="requests to send (default: 6)"
    )
    parser.add_argument(
        "--max-tokens",
        type=_bounded_int(1, 256),
        default=32,
        help="tokens to generate per request (default: 32)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep server logs after a successful run"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
