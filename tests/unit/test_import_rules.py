"""What each half of the connector brings into its process, checked in fresh interpreters."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "zmq", "vllm", "hixl_connector._native", "msgpack")


def loaded_after(statement: str) -> list[str]:
    probe = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_scheduler_half_imports_no_torch_zmq_vllm_or_engine() -> None:
    modules = loaded_after("import hixl_connector.connector.scheduler")
    assert [m for m in HEAVY if m in modules] == []


def test_importing_the_package_loads_nothing_but_itself() -> None:
    """vLLM imports the connector's package in its API-server process too."""
    modules = loaded_after("import hixl_connector")
    assert [m for m in HEAVY if m in modules] == []


PACKAGE = Path(__file__).resolve().parents[2] / "hixl_connector"
# Layer -> the layers it may import. Tools may import everything.
ALLOWED = {
    "datadist": {"datadist"},
    "connector": {"connector", "datadist"},
    "tools": {"tools", "connector", "datadist"},
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hixl_connector" else None


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_each_layer_imports_only_the_layers_below_it() -> None:
    breaches = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for module in imported_modules(path):
                target = layer_of(module)
                # hixl_connector._native is the datadist back-end's own extension.
                if target == "_native" and layer in ("datadist", "tools"):
                    continue
                if target is not None and target not in allowed:
                    breaches.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert breaches == []
