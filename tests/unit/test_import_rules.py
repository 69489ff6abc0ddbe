"""What each half of the connector brings into its process, checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "zmq", "vllm", "hixl_connector._native", "msgpack")


def loaded_after(statement: str) -> list[str]:
    probe = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_scheduler_half_imports_no_torch_zmq_vllm_or_engine() -> None:
    modules = loaded_after("import hixl_connector.scheduler")
    assert [m for m in HEAVY if m in modules] == []


def test_importing_the_package_loads_nothing_but_itself() -> None:
    """vLLM imports the connector's package in its API-server process too."""
    modules = loaded_after("import hixl_connector")
    assert [m for m in HEAVY if m in modules] == []
