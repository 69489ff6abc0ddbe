"""What each half of the connector brings into its process, checked in fresh interpreters."""

from __future__ import annotations

import ast
import json
import re
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


def test_the_scheduler_half_imports_no_torch_zmq_vllm_engine_or_datadist() -> None:
    modules = loaded_after("import hixl_connector.connector.scheduler.half")
    assert [m for m in (*HEAVY, "hixl_connector.datadist") if m in modules] == []


def test_the_planning_room_is_pure() -> None:
    rooms = PACKAGE / "connector" / "mapping"
    names = [f"hixl_connector.connector.mapping.{path.stem}" for path in rooms.glob("[!_]*.py")]
    modules = loaded_after("; ".join(f"import {name}" for name in names))
    assert [m for m in (*HEAVY, "hixl_connector.datadist") if m in modules] == []


CONNECTOR = "hixl_connector.connector"
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def ranked_rooms() -> tuple[str, ...]:
    """The connector's rooms from the bottom up, as docs/architecture.md ranks them: a module
    imports only from its own room or one below it. A room is a folder of connector/ or a
    module beside the facade."""
    section = ARCHITECTURE.read_text().split("## The connector's rooms, bottom up")[1]
    section = section.split("\n## ")[0]
    return tuple(re.findall(r"^\d+\. `([a-z_]+)`:", section, flags=re.MULTILINE))


ROOMS = ranked_rooms()
# Below it or not, the scheduler half reaches neither the worker half, the KV, push, nor the
# network (test_the_scheduler_half_imports_... checks what that loads).
SCHEDULER_NEVER = (
    "kv",
    "push",
    "peers.side_channel",
    "peers.registry",
    "leases.client",
    "leases.server",
)


def connector_modules() -> dict[str, Path]:
    folder = PACKAGE / "connector"
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((CONNECTOR, *parts))] = path
    return modules


def room_of(module: str) -> str:
    rest = module.removeprefix(CONNECTOR).lstrip(".")
    return rest.split(".")[0] if rest else "facade"


def connector_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The connector's own modules ``path`` imports (``from a import b`` of a module b: b)."""
    found = set()
    for name in imported_names(path):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith(CONNECTOR + "."):
            found.add(name)
    return found


def test_every_room_of_the_connector_is_ranked() -> None:
    assert len(ROOMS) == len(set(ROOMS))
    assert {room_of(module) for module in connector_modules()} == set(ROOMS)
    # The page names what the scheduler half never reaches, as this test checks it.
    never = ARCHITECTURE.read_text().split("The scheduler half never reaches")[1].split(".\n")[0]
    assert sorted(re.findall(r"`([a-z_.]+)`", never)) == sorted(SCHEDULER_NEVER)


def test_no_import_inside_the_connector_runs_upward() -> None:
    modules = connector_modules()
    breaches = []
    for module, path in modules.items():
        room = room_of(module)
        for target in connector_imports(path, modules):
            if ROOMS.index(room_of(target)) > ROOMS.index(room):
                breaches.append(f"{module} ({room}) imports {target} ({room_of(target)})")
            if room == "scheduler" and any(
                target.startswith(f"{CONNECTOR}.{name}") for name in SCHEDULER_NEVER
            ):
                breaches.append(f"the scheduler half's {module} imports {target}")
        if room in ("scheduler", "mapping"):
            breaches += [
                f"{module} imports {name}"
                for name in imported_modules(path)
                if layer_of(name) == "datadist"
            ]
    assert breaches == []


def test_the_connectors_imports_have_no_circle() -> None:
    modules = connector_modules()
    graph = {
        module: connector_imports(path, modules) - {module} for module, path in modules.items()
    }
    # A package's __init__ is imported by its modules' imports; it imports none of them here.
    done: set[str] = set()
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(" -> ".join(trail[trail.index(module) :] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == []


def test_importing_the_package_loads_nothing_but_itself() -> None:
    """vLLM imports the connector's package in its API-server process too."""
    modules = loaded_after("import hixl_connector")
    assert [m for m in HEAVY if m in modules] == []


PACKAGE = Path(__file__).resolve().parents[2] / "hixl_connector"
# Layer -> the layers it may import. Tools may import everything.
ALLOWED = {
    "datadist": {"datadist"},
    "connector": {"connector", "datadist"},
    "fabric_check": {"fabric_check", "connector", "datadist"},
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


BENCH_MODULE = "hixl_connector._native_bench"
# Copies between arbitrary addresses, reads of other processes, self-tests and primitives for
# tests: they live in the bench module, never in the engine module the connector loads.
BENCH_ONLY = (
    "scatter_copy",
    "scatter_read_process",
    "tcp_stream",
    "thread_pool_selftest",
    "time_plan",
    "plan_runs",
    "hmac_sha256",
    "sha256",
)


def imported_names(path: Path) -> set[str]:
    """Every module or module attribute a file imports, as absolute dotted names
    (``from a import b`` gives ``a`` and ``a.b``; relative imports are resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_engine_module_exports_no_bench_or_test_helper() -> None:
    from hixl_connector import _native, _native_bench

    assert [name for name in BENCH_ONLY if hasattr(_native, name)] == []
    assert [name for name in BENCH_ONLY if not hasattr(_native_bench, name)] == []


def test_the_connector_and_datadist_never_import_the_bench_module() -> None:
    breaches = []
    for layer in ("connector", "datadist"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for name in imported_names(path):
                if name == BENCH_MODULE or name.startswith(BENCH_MODULE + "."):
                    breaches.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert breaches == []
    # The engine the datadist back-end loads does not pull it in either.
    modules = loaded_after(
        "from hixl_connector.datadist.native.llm_datadist import load_native; load_native()"
    )
    assert "hixl_connector._native" in modules
    assert BENCH_MODULE not in modules


DATADIST_SEAM = (
    "hixl_connector.datadist",
    "hixl_connector.datadist.backend",
    "hixl_connector.datadist.profile",
)


def test_the_connector_reaches_datadist_only_through_its_seam() -> None:
    """The package, ``backend`` and ``profile``: never a back-end's module, never the part of
    the native back-end that serves only HIXL's samples (``native.parity``)."""
    breaches = []
    for layer in ("connector", "fabric_check"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for module in imported_modules(path):
                if layer_of(module) == "datadist" and module not in DATADIST_SEAM:
                    breaches.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert breaches == []


def test_the_api_room_of_datadist_imports_no_back_end() -> None:
    breaches = []
    for path in sorted((PACKAGE / "datadist" / "api").rglob("*.py")):
        for module in imported_modules(path):
            if module.startswith(
                ("hixl_connector.datadist.native", "hixl_connector.datadist.ascend")
            ):
                breaches.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert breaches == []
