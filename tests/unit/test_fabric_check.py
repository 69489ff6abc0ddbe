"""``python -m hixl_connector check`` run as a user runs it: on the native engine here, and on
the "ascend" back-end over the llm_datadist STAND-IN in each Ascend link mode (prefill and
decode in two real processes, real links, real reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from standin_imports import STANDIN_DIR

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "ascend"
CHECK_TIMEOUT_S = 240
SMALL = ["--blocks", "8", "--block-kib", "16", "--reads", "3", "--json"]


def check(*args: str, standin: bool = False) -> tuple[int, dict[str, Any]]:
    env = dict(os.environ)
    if standin:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDIN_DIR), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "hixl_connector", "check", *args, *SMALL],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHECK_TIMEOUT_S,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return done.returncode, json.loads(lines[-1])


def test_native_engine_passes_in_host_memory() -> None:
    code, result = check("--backend", "native")
    assert (code, result["ok"]) == (0, True), result
    assert "native engine" in result["fabric"]
    assert set(result["placements_prefill"].values()) == {"HOST"}
    assert set(result["placements_decode"].values()) == {"HOST"}
    assert result["median_gbps"] > 0 and result["guard_us"] > 0


def test_ascend_back_end_passes_on_every_fabric_with_device_memory_only(
    standin_fabric: str,
) -> None:
    """With the A3 config file as configs/ascend/README.md runs it (the host 127.0.0.1)."""
    template = (CONFIGS / "a3-prefill.json").read_text()
    config = template.replace("${P_HOST_IP}", "127.0.0.1").replace("${D_HOST_IP}", "127.0.0.1")
    code, result = check("--kv-transfer-config", config, standin=True)
    assert result["backend"] == "ascend"
    assert (code, result["ok"]) == (0, True), result
    assert result["fabric"].endswith(f"link mode {standin_fabric}")
    placements = {**result["placements_prefill"], **result["placements_decode"]}
    assert {"lease words", "scratch rows", "kv model_id 0"} <= set(placements)
    assert set(placements.values()) == {"DEVICE"}


def test_a_failed_link_names_the_step_and_a_fix() -> None:
    from hixl_connector.tools.demo.processes import free_port

    config = json.dumps({"kv_connector_extra_config": {"handshake_timeout_s": 1}})
    code, result = check(
        "--backend", "native", "--connect", f"127.0.0.1:{free_port()}",
        "--kv-transfer-config", config,
    )  # fmt: skip
    assert (code, result["ok"], result["stage"]) == (1, False, "link"), result
    assert "link_clusters to cluster" in result["error"]
    assert "reaches P's engine host and port" in result["fix"]
