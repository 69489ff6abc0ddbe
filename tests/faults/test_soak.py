"""The soak, short form: ``python -m hixl_connector soak`` as a user runs it.

500 requests of varied prompt length at concurrency 8 through vllm-router, P and D, with
short outputs (4 tokens) so it fits CI; ``--long-faults`` runs 2000 requests of 16 tokens.
The command itself checks token identity, idle KV on P and D and memory growth against a
plain vLLM server's; the test checks its exit status and records the summary.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .fault_harness import FaultReport

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_soak_through_router(tmp_path: Path, long_faults: bool, fault_report: FaultReport) -> None:
    requests, max_tokens = (2000, 16) if long_faults else (500, 4)
    argv = [sys.executable, "-m", "hixl_connector", "soak", "--requests", str(requests)]
    argv += ["--concurrency", "8", "--max-tokens", str(max_tokens), "--work-dir", str(tmp_path)]
    done = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600 if long_faults else 900
    )
    print(done.stdout[-4000:], done.stderr[-2000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: PASS" in done.stdout
    latency = re.search(r"p50 ([\d.]+) ms, p99 ([\d.]+) ms", done.stdout)
    plain_growth = re.search(r"the plain server grew ([+\-\d.]+) MiB", done.stdout)
    growth = re.findall(r"(prefill|decode|router)/[^ ]+ ([+\-\d.]+),?", done.stdout)
    assert latency is not None and plain_growth is not None and growth
    worst = {side: max(float(mb) for s, mb in growth if s == side) for side, _ in growth}
    fault_report.record(
        f"soak: {requests} requests, concurrency 8, via router",
        f"0 failures, 0 mismatches vs the plain run; KV-ready p50 {latency[1]} ms, "
        f"p99 {latency[2]} ms on D; memory growth after warm-up (MiB): "
        + ", ".join(f"{side} {mb:+.1f}" for side, mb in sorted(worst.items()))
        + f" vs the plain server {plain_growth[1]} over the same requests",
        None,
        "P and D KV usage back to idle",
    )
