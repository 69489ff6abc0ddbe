"""The benchmark runs end to end and reports what it promises (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = (
    "request_gbps",
    "request_ms_p50",
    "one_block_us_p50",
    "eight_blocks_us_p50",
    "memcpy_gbps",
    "ratio_to_memcpy",
    "client_peak_internal_bytes",
    "server_peak_internal_bytes",
    # The transport's bare reference in the same run (cma: process_vm_readv; tcp: sockets).
    "bare_gbps",
    "bare_ratio_to_memcpy",
    "ratio_to_bare",
    # push_blocks of the same request, in the same rotation.
    "push_gbps",
    "push_ratio_to_memcpy",
    "push_one_block_us_p50",
)


def test_bench_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "hixl_connector", "bench", "--quick", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "GB/s" in done.stdout and "planning" in done.stdout and "bare ratio" in done.stdout
    assert "push ratio" in done.stdout
    report = json.loads(out.read_text())
    assert report["plan_us_128_blocks_x_64_tensors"] > 0
    assert report["config"]["tensors"] == 64
    assert set(report["transports"]) == {"cma", "tcp"}
    for transport, blocks in report["transports"].items():
        assert set(blocks) == {"block16", "block128"}
        for name, figures in blocks.items():
            assert figures["transport_used"] == transport
            for key in FIGURES:
                assert figures[key] > 0, (transport, name, key)


def test_bench_tp_quick_json(tmp_path: Path) -> None:
    """Each mismatched pull verifies the bytes of every head slot (it raises otherwise)."""
    out = tmp_path / "bench_tp.json"
    cmd = [sys.executable, "-m", "hixl_connector", "bench-tp", "--quick", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"cma", "tcp"}
    for transport, cases in report.items():
        assert set(cases) == {"P tp2 -> D tp1", "P tp1 -> D tp2"}
        for name, figures in cases.items():
            for key in ("gbps", "reference_gbps", "ratio"):
                assert figures[key] > 0, (transport, name, key)
            # Nothing staged: the engine's own memory (two pulls in flight at most) stays far
            # below the 32 MiB one quick request moves.
            assert figures["client_peak_internal_bytes"] < 4 << 20, (transport, name)


def test_unknown_command_lists_commands() -> None:
    cmd = [sys.executable, "-m", "hixl_connector", "nope"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bench" in done.stdout
