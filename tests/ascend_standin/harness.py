"""Shared by the ascend stand-in tests: put the llm_datadist STAND-IN on sys.path (and take it
off again), free ports, and bounded child processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@contextmanager
def standin_on_path() -> Iterator[Any]:
    """Makes ``import llm_datadist`` find the stand-in while the block runs."""
    sys.path.insert(0, str(HERE))
    try:
        import llm_datadist

        assert getattr(llm_datadist, "STANDIN", False), "a real llm_datadist shadows the stand-in"
        yield llm_datadist
    finally:
        sys.path.remove(str(HERE))
        for name in [m for m in sys.modules if m.split(".")[0] == "llm_datadist"]:
            del sys.modules[name]


def start(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Any]:
    """Starts ``cmd`` and returns it with the JSON of its first stdout line (bounded wait)."""
    proc = launch(cmd, env)
    return proc, ready(proc)


def launch(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env
    )


def ready(proc: subprocess.Popen[str]) -> Any:
    """The JSON of the child's first stdout line, its "ready" signal (bounded wait)."""
    assert proc.stdout is not None
    selected, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if selected else ""
    if not line:
        stop(proc)
        raise RuntimeError(f"{proc.args!r:.120} did not become ready within {READY_TIMEOUT_S}s")
    return json.loads(line)


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    if not ready:
        raise RuntimeError(f"no answer to {command!r} within {READY_TIMEOUT_S}s")
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen[str]) -> str:
    """Closes stdin (the child's signal to finish) and returns what it printed last."""
    out = ""
    try:
        out, _ = (
            proc.communicate(input="", timeout=STOP_TIMEOUT_S) if proc.poll() is None else ("", "")
        )
    except (subprocess.TimeoutExpired, ValueError, OSError):
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
    return out or ""


def launch_prefill_worker(spec: dict[str, Any], directory: Path) -> subprocess.Popen[str]:
    """prefill_worker.py (a real HixlWorker as P, in its own process) with ``spec``, its JSON
    written into ``directory``; not waited for (``ready`` does)."""
    spec_file = directory / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return launch([sys.executable, str(HERE / "prefill_worker.py"), str(spec_file)], env)


def prefill_extra(side_host: str, cluster_id_base: int) -> dict[str, Any]:
    """The connector's config of a stand-in P on the "ascend" back-end: its side channel on
    ``side_host``, its engine on IPv4 loopback (as CANN requires), each on a free port."""
    from hixl_connector.tools.demo.processes import free_port

    return {
        "backend": "ascend",
        "side_channel_host": side_host,
        "side_channel_port": free_port(side_host),
        "engine_host": "127.0.0.1",
        "engine_port": free_port(),
        "cluster_id_base": cluster_id_base,
    }


def launch_prefill(
    model_dir: Path,
    engine_id: str,
    extra: dict[str, Any],
    leases: Any,
    directory: Path,
    state: bool = False,
) -> subprocess.Popen[str]:
    """launch_prefill_worker for P engine ``engine_id`` of ``model_dir`` with the connector's
    ``extra`` config, leasing ``leases`` (its TP group on a free port); with ``state``, a
    hybrid state model's caches."""
    from hixl_connector.tools.demo.processes import free_port

    spec = {
        "model_dir": str(model_dir),
        "engine_id": engine_id,
        "extra": extra,
        "tp_port": free_port(),
        "leases": leases,
        "state": state,
    }
    return launch_prefill_worker(spec, directory)
