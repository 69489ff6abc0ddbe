"""bench-serve's hook timer: loaded through PYTHONPATH into a fresh interpreter, it times the
real HixlConnector's hooks once the facade is imported and writes them out; the report reads
them back per engine step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hixl_connector.tools.hook_timer.sitecustomize import WAIT_NS, time_hooks
from hixl_connector.tools.hook_times import dumps, summary, timer_env

# A process that imports the facade, calls two of its hooks on a bare instance (no engine),
# and stays up long enough for the timer to write.
PROBE = """
import time
from hixl_connector.connector.facade import HixlConnector
connector = object.__new__(HixlConnector)
connector._scheduler = None
connector._worker = None
for _ in range(3):
    connector.get_block_ids_with_load_errors()
print(HixlConnector.get_block_ids_with_load_errors.__wrapped__.__name__, flush=True)
time.sleep(3)
"""


def test_a_server_process_times_the_facades_hooks_and_writes_them(tmp_path: Path) -> None:
    env = {**os.environ, **timer_env(tmp_path / "d")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "get_block_ids_with_load_errors"  # wrapped, the real hook
    (path,) = tmp_path.glob("d.*.json")
    record = json.loads(path.read_text())
    assert record["hooks"]["get_block_ids_with_load_errors"][0] == 3
    assert record["hooks"]["start_load_kv"][0] == 0
    assert record["threads"]  # this process's threads and their CPU ticks
    # No connector was built in it (as in vLLM's API server): the report leaves it out.
    assert record["role"] == {} and dumps(tmp_path) == []


def test_without_the_variable_nothing_is_wrapped(tmp_path: Path) -> None:
    env = {**os.environ, **timer_env(tmp_path / "d")}
    del env["HIXL_HOOK_TIMES"]
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "__wrapped__" in out.stderr
    assert dumps(tmp_path) == []


def test_the_report_gives_each_hooks_cost_per_step_with_waits_apart() -> None:
    class Connector:
        def __init__(self, vllm_config: object, role: object) -> None:
            self.config = vllm_config

        def build_connector_meta(self) -> None:
            pass

        def get_transfer_results(self, wait_s: float) -> None:
            time.sleep(wait_s)

    stats: dict[str, list[int]] = {}
    role: dict[str, str] = {}
    time_hooks(Connector, stats, role)
    config = type(
        "C", (), {"kv_transfer_config": type("K", (), {"engine_id": "d", "kv_role": "kv_consumer"})}
    )
    connector = Connector(config, None)
    for step in range(4):
        connector.build_connector_meta()
        connector.get_transfer_results(0.002 if step == 0 else 0.0)  # one idle step's wait
    assert role == {"engine": "d kv_consumer"}
    calls, ns, waits, waited_ns = stats["get_transfer_results"]
    assert (calls, waits) == (4, 1) and waited_ns >= 2_000_000 > WAIT_NS
    lines = summary("pull-decode", {"role": role, "hooks": stats, "threads": {"main:1": 7}})
    assert lines[0] == "pull-decode (d kv_consumer): 4 engine steps"
    assert any("get_transfer_results" in line and "1 waits of" in line for line in lines)
    own = next(line for line in lines if "own time" in line)
    assert float(own.split(":")[1].split()[0]) < 1000  # the wait is not a step's cost
    assert json.dumps(stats)  # what the timer writes is plain JSON
