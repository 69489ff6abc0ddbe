"""``bench-serve --time-hooks``: what HixlConnector's hooks cost per engine step inside each
P and D server (timed by tools/hook_timer, loaded into the servers), and the CPU of each of
the servers' threads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hixl_connector.tools.hook_timer import sitecustomize as timer

# A step of vLLM's engine calls this hook once.
STEP_HOOK = "build_connector_meta"


def timer_env(out: Path) -> dict[str, str]:
    """What a server's environment needs for its hooks to be timed into ``out``.*.json."""
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = str(Path(timer.__file__).parent)
    path = os.environ.get("PYTHONPATH")
    return {timer.ENV: str(out), "PYTHONPATH": folder + (os.pathsep + path if path else "")}


def dumps(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """What each process timed into ``folder`` wrote last (its role, hooks and threads), by
    the name it was timed under; processes that only imported the connector (vLLM's API
    server) are left out."""
    found = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if record["role"]:
            found.append((path.name.split(".")[0], record))
    return found


def summary(name: str, record: dict[str, Any]) -> list[str]:
    """Lines for the process timed as ``name``: per hook its calls per step and µs a call,
    waits apart, then the connector's own time per step and the busiest threads."""
    hooks: dict[str, list[int]] = record["hooks"]
    steps = hooks.get(STEP_HOOK, [0])[0]
    lines = [f"{name} ({record['role'].get('engine', '?')}): {steps} engine steps"]
    own_ns = 0
    for name, (calls, ns, waits, waited_ns) in sorted(hooks.items(), key=lambda kv: -kv[1][1]):
        if not calls:
            continue
        own_ns += ns - waited_ns
        per_call = (ns - waited_ns) / max(1, calls - waits) / 1000
        waited = f", {waits} waits of {waited_ns / waits / 1e6:.1f} ms" if waits else ""
        lines.append(
            f"  {name:30s} {calls / max(1, steps):5.2f} a step, {per_call:7.1f} µs{waited}"
        )
    if steps:
        lines.append(f"  the connector's own time: {own_ns / steps / 1000:.1f} µs a step")
    busiest = sorted(record["threads"].items(), key=lambda kv: -kv[1])[:6]
    lines.append("  busiest threads (CPU ticks): " + ", ".join(f"{n} {t}" for n, t in busiest))
    return lines
