"""The README's main command, ``python -m hixl_connector demo``, run as a user would run it."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hixl_connector.tools.demo.client import Generation
from hixl_connector.tools.demo.pd_report import summarize
from hixl_connector.tools.demo.pd_workload import RequestResult, TransferDelta, build_requests

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 420
SUMMARY = re.compile(
    r"^summary: (?P<same>\d+)/(?P<total>\d+) outputs token-identical, (?P<blocks>\d+) blocks",
    re.MULTILINE,
)


def run_demo(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run the demo; on timeout send SIGTERM first so that it stops the servers it started."""
    command = [sys.executable, "-m", "hixl_connector", "demo", *args]
    with subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            pytest.fail(f"demo did not finish within {timeout_s} s:\n{output[-6000:]}")
        return subprocess.CompletedProcess(command, proc.returncode, output, None)


def test_demo_outputs_identical_and_kv_pulled(tmp_path: Path) -> None:
    for module in ("vllm", "transformers", "vllm_router"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the demo needs {module!r} (install the cpu and dev extras)")
    done = run_demo(["--prompts", "3", "--work-dir", str(tmp_path)], DEMO_TIMEOUT_S)
    report = f"demo exit code {done.returncode}, output:\n{done.stdout[-8000:]}"
    assert done.returncode == 0, report
    summary = SUMMARY.search(done.stdout)
    assert summary is not None, report
    assert int(summary["total"]) == 3, report
    assert summary["same"] == summary["total"], report
    assert int(summary["blocks"]) > 0, report
    assert "PASS" in done.stdout, report
    # Logs of a successful run are removed unless --keep-logs.
    assert not any((tmp_path / "logs").glob("*/*.log")), report


def _result(routed_ids: list[int], plain_ids: list[int], pulls: int) -> RequestResult:
    def generation(ids: list[int]) -> Generation:
        return Generation("text", ids, list(range(70)), "length", None, 0.1)

    transfer = TransferDelta(
        pulls=pulls,
        blocks=3 * pulls,
        bytes=3 * pulls * 32768,
        pull_s=0.0002 * pulls,
        kv_ready_s=0.002 * pulls,
        failed=0,
        external_tokens=70 * pulls,
    )
    return RequestResult(
        build_requests(1)[0], generation(routed_ids), generation(plain_ids), transfer
    )


def test_summary_verdict_fails_on_a_mismatch_or_a_missing_pull() -> None:
    """The demo's exit status rests on this verdict; it must not pass what it should flag."""
    good = _result([5, 6, 7], [5, 6, 7], pulls=1)
    verdict = summarize([good, good])
    assert verdict.ok
    assert SUMMARY.search("\n".join(verdict.lines))["blocks"] == "6"  # type: ignore[index]

    mismatch = summarize([good, _result([5, 6, 8], [5, 6, 7], pulls=1)])
    assert not mismatch.ok
    assert "summary: 1/2 outputs token-identical" in mismatch.lines[0]
    assert "1 outputs differ" in mismatch.lines[-1]

    recomputed = summarize([good, _result([5, 6, 7], [5, 6, 7], pulls=0)])
    assert not recomputed.ok
    assert "pulled nothing" in recomputed.lines[-1]
    assert not summarize([_result([1], [1], pulls=0)]).ok
    assert not summarize([_result([], [], pulls=1)]).ok  # nothing generated is no evidence
