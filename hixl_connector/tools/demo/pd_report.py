"""What the demo prints: each request beside the plain run, then a summary and the verdict."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hixl_connector.tools.demo.pd_workload import RequestResult, TransferDelta

TEXT_WIDTH = 60
BLOCK_SIZE = 32


def shorten(text: str, width: int = TEXT_WIDTH) -> str:
    """One line, at most ``width`` characters, quoted so that leading spaces show.

    The tiny model's byte-level tokens often end mid-character; such bytes decode to U+FFFD,
    shown here as "?" like any other unprintable character.
    """
    flat = "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in " ".join(text.split()))
    if len(flat) > width:
        flat = flat[: width - 3] + "..."
    return f'"{flat}"'


def size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def transfer_line(delta: TransferDelta, prompt_tokens: int) -> str:
    if delta.pulls == 0:
        failed = f", {delta.failed} failed" if delta.failed else ""
        return f"transfer: NOTHING PULLED (D recomputed the prompt{failed})"
    pulls = f" in {delta.pulls} pulls" if delta.pulls > 1 else ""
    plural = "" if delta.blocks == 1 else "s"
    failed = f", {delta.failed} FAILED" if delta.failed else ""
    ready = ms(delta.kv_ready_s / delta.pulls)
    # A read in the step leaves the last prompt token to that step's forward, for its logits.
    when = "in the step of the first token" if delta.sync_loads else "asynchronous"
    return (
        f"transfer: {delta.blocks} block{plural}, {size(delta.bytes)}{pulls} ({when}), "
        f"pull {ms(delta.pull_s)} ({delta.gbps:.2f} GB/s), KV ready on D {ready}, "
        f"{delta.external_tokens}/{prompt_tokens} prompt tokens from P{failed}"
    )


def request_lines(index: int, total: int, result: RequestResult) -> list[str]:
    n = result.prompt_tokens
    blocks = -(-n // BLOCK_SIZE)
    plural = "" if blocks == 1 else "s"
    mark = "match" if result.identical else "MISMATCH"
    lines = [
        f"[{index}/{total}] {result.spec.label}: {n} prompt tokens ({blocks} block{plural}), "
        f"{len(result.plain.token_ids)} generated",
        f"    P/D   {shorten(result.routed.text)}",
        f"    plain {shorten(result.plain.text)}   {mark}",
        "    " + transfer_line(result.transfer, n),
        f"    latency: {result.routed.latency_s:.3f} s through the router (P+D), "
        f"{result.plain.latency_s:.3f} s plain",
    ]
    if not result.identical:
        lines.append(f"    P/D   token ids {result.routed.token_ids}")
        lines.append(f"    plain token ids {result.plain.token_ids}")
    return lines


@dataclass
class Verdict:
    ok: bool
    lines: list[str]


def summarize(results: Sequence[RequestResult]) -> Verdict:
    """Summary lines and pass/fail: every output identical, and D pulled for every request."""
    identical = sum(r.identical for r in results)
    deltas = [r.transfer for r in results]
    pulls = sum(d.pulls for d in deltas)
    blocks = sum(d.blocks for d in deltas)
    nbytes = sum(d.bytes for d in deltas)
    failed = sum(d.failed for d in deltas)
    busy = sum(d.pull_s for d in deltas)
    ready = [d.kv_ready_s / d.pulls for d in deltas if d.pulls]
    pull_times = [d.pull_s / d.pulls for d in deltas if d.pulls]
    unpulled = sum(1 for d in deltas if d.pulls == 0)
    lines = [
        f"summary: {identical}/{len(results)} outputs token-identical, {blocks} blocks "
        f"({size(nbytes)}) pulled in {pulls} pulls, {failed} failed",
    ]
    if ready:
        lines.append(
            f"  connector overhead per request, KV-ready latency on D (pull queued -> KV in "
            f"place): p50 {ms(statistics.median(ready))}, max {ms(max(ready))}; pull alone: "
            f"p50 {ms(statistics.median(pull_times))}; {nbytes / busy / 1e9:.2f} GB/s overall"
        )
    if results:
        routed = [r.routed.latency_s for r in results]
        plain = [r.plain.latency_s for r in results]
        lines.append(
            f"  end-to-end latency p50 (max): {statistics.median(routed):.3f} s "
            f"({max(routed):.3f} s) through the router vs {statistics.median(plain):.3f} s "
            f"({max(plain):.3f} s) plain"
        )
    problems = []
    if identical < len(results):
        problems.append(f"{len(results) - identical} outputs differ from the plain run")
    if blocks == 0:
        problems.append("nothing was pulled")
    elif unpulled:
        problems.append(f"{unpulled} requests pulled nothing (D recomputed them)")
    if failed:
        problems.append(f"{failed} pulls failed")
    if problems:
        lines.append("FAIL: " + "; ".join(problems))
    else:
        lines.append("PASS: P/D through hixl_connector gives the plain server's exact tokens")
    return Verdict(not problems, lines)
