"""Fixtures and options of the fault matrix (real vLLM CPU servers and engine processes).

Options:
- ``--fuzz-examples N``: hostile inputs per fuzz target (default 2000; e.g. 50000 for a long run);
- ``--long-faults``: the longer variants (a 500-request soak at 64 output tokens, more rounds);
- ``--fault-report PATH``: where the measured rows of the reliability table go (JSON;
  default ``artifacts/faults/reliability.json``). Render them with
  ``python -m hixl_connector reliability --from PATH --update docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.harness import tiny_model_or_skip

from hixl_connector.tools.netns import NetnsBed, NetnsUnavailable, make_bed

from .deployments import short_lease_pair
from .fault_harness import FaultReport, Servers

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPORT = REPO_ROOT / "artifacts" / "faults" / "reliability.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hixl faults")
    group.addoption("--fuzz-examples", type=int, default=2000, help="inputs per fuzz target")
    group.addoption("--long-faults", action="store_true", help="run the long fault variants")
    group.addoption("--fault-report", default=str(DEFAULT_REPORT), help="reliability JSON path")


@pytest.fixture(scope="session")
def fuzz_examples(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--fuzz-examples"))


@pytest.fixture(scope="session")
def long_faults(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--long-faults"))


@pytest.fixture(scope="session")
def fault_report(request: pytest.FixtureRequest) -> FaultReport:
    path = Path(request.config.getoption("--fault-report"))
    report = FaultReport(path)
    if path.exists():  # keep rows of cases this run does not repeat (-k)
        import json

        report.rows = list(json.loads(path.read_text()).get("cases", []))
    return report


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_or_skip(tmp_path_factory, "fault", "fault_model")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault_logs")


@pytest.fixture(scope="session")
def lease_pd(model_dir: Path, log_dir: Path) -> Iterator[Servers]:
    """P and D with seconds-long leases, TCP transport and an auth token (deployments.py).

    Shared by test_hostile_input.py and test_pd_faults.py; the latter kills D last.
    """
    with Servers(model_dir, log_dir / "pd", short_lease_pair()) as servers:
        servers.start("prefill", "decode")
        yield servers


@pytest.fixture(scope="module")
def net() -> Iterator[NetnsBed]:
    """P's, D's and the router's network namespaces (netns.py), for one module's servers."""
    try:
        bed = make_bed()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    try:
        yield bed
    finally:
        bed.remove()
