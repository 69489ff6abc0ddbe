"""Puts ``tests/support`` (the test-only connector) on the path of the tests and of every
process they start, and turns off hypothesis's per-example deadline: these machines are
shared and noisy, and no test here is about speed."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("shared-machines", deadline=None)
settings.load_profile("shared-machines")

SUPPORT = str(Path(__file__).resolve().parent / "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SUPPORT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
)

# The only skips the test command accepts (HIXL_STRICT_SKIPS=1, set by .ci/test): a skip for
# any other reason (a missing package, no network namespaces, no NIXL) fails the run, so a
# suite that should run on the CI machine cannot pass by not running.
ALLOWED_SKIPS = {
    "CANN llm_datadist is not installed": "the ascend back-end runs on Ascend hosts only",
    "this vLLM refuses the hybrid manager": "vLLM versions without failed-receive reports",
    "this vLLM reports failed reads by request": "vLLM versions with failed-receive reports",
    "no IPv6 loopback here": "hosts without an IPv6 loopback address",
    "ARCHITECTURE.md is outside this checkout": "a clone without ../shared/ beside it (CI's)",
}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("HIXL_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    unexpected = []
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(allowed in reason for allowed in ALLOWED_SKIPS):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        print("\nskips the test command does not allow (tests/conftest.py ALLOWED_SKIPS):")
        for line in unexpected:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The Ascend link modes the llm_datadist stand-in enforces (its fabric.py reads the variable).
STANDIN_FABRIC_ENV = "HIXL_STANDIN_FABRIC"
STANDIN_FABRICS = ("hccs-a2", "hccs-a3", "roce")


@pytest.fixture(scope="module", params=STANDIN_FABRICS)
def standin_fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs every stand-in test in each Ascend link mode, in this process and those it
    starts: what a fixture builds on it (engines, peers) is built again for each mode."""
    previous = os.environ.get(STANDIN_FABRIC_ENV)
    os.environ[STANDIN_FABRIC_ENV] = request.param
    try:
        yield request.param
    finally:
        if previous is None:
            del os.environ[STANDIN_FABRIC_ENV]
        else:
            os.environ[STANDIN_FABRIC_ENV] = previous
