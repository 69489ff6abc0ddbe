"""One fleet of real vLLM CPU servers for every deployment-shape test, started once.

- ``p1``, ``p2``: prefill servers with TP 1 and TP 2;
- ``d1``, ``d2``: decode servers with TP 1 and TP 2;
- ``d1_corrupt``: a TP-1 decode server with 64-token blocks that overwrites what it pulled
  (the control, for hetero TP and block sizes at once);
- ``d_kv4``: a TP-1 decode server of the same model with 4 KV heads instead of 2 (refused);
- ``pd64``: a TP-1 server with 64-token blocks (the others have 32), both prefill and decode.
Every server of the fleet requires the auth token ``AUTH_TOKEN``. Routers are started per
test from these (they are cheap); everything stops at the end of the package. No server is
pinned to a core: a TP-2 server binds its workers' OpenMP threads to both cores, and a TP-1
server pinned beside one of them was starved for tens of seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.servers import VllmServer
from hixl_connector.tools.demo.tiny_model import build_tiny_model

from ..harness import BLOCK_SIZE, PDLauncher, ProcessRegistry
from ..harness import hixl_connector_config as plain_config

AUTH_TOKEN = "shapes-fleet-token-0123456789abcdef0123456"


def hixl_connector_config(role: str, ranks: int = 1, **extra: Any) -> dict[str, Any]:
    return plain_config(role, ranks, auth_token=AUTH_TOKEN, **extra)


@dataclass
class Fleet:
    launcher: PDLauncher
    p1: VllmServer
    p2: VllmServer
    d1: VllmServer
    d2: VllmServer
    d1_corrupt: VllmServer
    d_kv4: VllmServer
    pd64: VllmServer


@pytest.fixture(scope="package")
def fleet(
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    kv4_model = build_tiny_model(tmp_path_factory.mktemp("llama_kv4") / "model", "llama-kv4")
    with PDLauncher(tiny_model_dir, e2e_log_dir / "shapes", process_registry) as launcher:
        corrupt = hixl_connector_config("decode", test_corrupt_received_kv=True)
        both = hixl_connector_config("decode") | {"kv_role": "kv_both"}
        servers = Fleet(
            launcher,
            p1=launcher.server("p1", hixl_connector_config("prefill")),
            p2=launcher.server("p2", hixl_connector_config("prefill", ranks=2), tp=2),
            d1=launcher.server("d1", hixl_connector_config("decode")),
            d2=launcher.server("d2", hixl_connector_config("decode", ranks=2), tp=2),
            d1_corrupt=launcher.server("d1_corrupt", corrupt, block_size=2 * BLOCK_SIZE),
            d_kv4=launcher.server("d_kv4", hixl_connector_config("decode"), model_dir=kv4_model),
            pd64=launcher.server("pd64", both, block_size=2 * BLOCK_SIZE),
        )
        for server in (
            servers.p1,
            servers.p2,
            servers.d1,
            servers.d2,
            servers.d1_corrupt,
            servers.d_kv4,
            servers.pd64,
        ):
            server.wait_healthy(launcher.health_timeout_s)
        yield servers
