"""Data parallel on both sides behind the real vllm-router: P and D each run
``--data-parallel-size 2``, two engines behind one API server.

Each engine of P serves its own side channel and transfer engine (its ports are the base plus
its DP rank times the TP size) under its own engine id, which vLLM suffixes with the rank
(``_dp0``, ``_dp1``); each engine of D links with whichever P engine prefilled its request.
The oracle is the plain server. Beside it: both of D's engines read, vLLM counts every prompt
token of a read as loaded through the connector, and the corrupted-KV control (a one-engine
D reading from P's DP engines) changes the outputs.

The leases here outlast a stall of vLLM's data-parallel engines: on a loaded 2-core host
their first requests were seen to wait about 30 s before D's scheduler took them, silent
all the while, and a lease of the default 30 s then expired under them (D's read was
refused, as it must be). Each DP engine runs its model in its own process (``PDLauncher.server``):
with a separate worker each, P's engines, stepping while they hold leases, kept every other
process on the host from running until the leases ended.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import Generation, metric_total, read_metrics
from hixl_connector.tools.demo.servers import VllmServer

from ..harness import (
    NamedFleet,
    PDLauncher,
    ProcessRegistry,
    external_prompt_tokens,
    generate_all,
    settled,
    wait_kv_idle,
)
from .conftest import hixl_connector_config

DP_SIZE = 2
LENGTHS = (33, 64, 97, 129, 160, 230)
LEASE_S = 120.0
# Two DP servers of six processes each, and a third server, start together on 2 cores: on a
# busy host vLLM alone took over 4 minutes to reach the connector's init, so they get more
# than the launcher's default 300 s; requests get more than the usual 180 s for the DP stall.
HEALTH_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
# D links each P engine while all of them settle on 2 cores: a handshake missed the default
# 5 s in CI, and the failure, remembered for a second, failed the requests behind it too.
HANDSHAKE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[NamedFleet]:
    launcher = PDLauncher(
        tiny_model_dir, e2e_log_dir / "data_parallel", process_registry, HEALTH_TIMEOUT_S
    )
    # One engine per core, as vLLM binds the OpenMP threads of each rank; D's ranks the other
    # way round from P's, so no core carries both first ranks (vLLM's CPU workers spin while
    # they wait, and a core shared by two of them starved a side channel for seconds).
    cores = [str(c) for c in range(DP_SIZE)]
    bind = {"p": "|".join(cores), "d": "|".join(reversed(cores))}
    decode: dict[str, Any] = {"lease_s": LEASE_S, "handshake_timeout_s": HANDSHAKE_TIMEOUT_S}
    with launcher:
        # Every DP engine of P has its own side-channel port: DP_SIZE of them.
        configs = {
            "p": hixl_connector_config("prefill", ranks=DP_SIZE, lease_s=LEASE_S),
            "d": hixl_connector_config("decode", **decode),
        }
        servers = {
            name: launcher.server(
                name, config, dp=DP_SIZE, env={"VLLM_CPU_OMP_THREADS_BIND": bind[name]}
            )
            for name, config in configs.items()
        }
        # The control: a one-engine D reading from P's DP engines, corrupting what it received.
        servers["d_corrupt"] = launcher.server(
            "d_corrupt",
            hixl_connector_config("decode", test_corrupt_received_kv=True, **decode),
        )
        pairs = {"dp": ("p", "d"), "corrupt": ("p", "d_corrupt")}
        yield NamedFleet(servers, launcher.pairs(servers, pairs))


def per_engine(server: VllmServer, name: str) -> list[float]:
    samples = read_metrics(server.url)
    return [metric_total(samples, name, engine=str(rank)) for rank in range(DP_SIZE)]


def pulls_per_engine(server: VllmServer) -> list[float]:
    return per_engine(server, "vllm:hixl_pulls_total")


def test_both_sides_data_parallel_token_identical(
    fleet: NamedFleet, plain_outputs: dict[Any, Generation]
) -> None:
    decode, prefill = fleet.servers["d"], fleet.servers["p"]
    served = per_engine(prefill, "vllm:request_success_total")
    before = pulls_per_engine(decode)
    external = external_prompt_tokens(decode.url)
    outputs = generate_all(fleet.routers["dp"].url, LENGTHS, REQUEST_TIMEOUT_S)
    for n in LENGTHS:
        assert outputs[n].token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
    after = settled(
        lambda: pulls_per_engine(decode),
        lambda now: sum(now) - sum(before) >= len(LENGTHS),
    )
    assert sum(after) - sum(before) == len(LENGTHS)
    assert all(a > b for a, b in zip(after, before, strict=True)), (
        f"pulls per D engine before {before}, after {after}: one engine read nothing"
    )
    # Every prompt token came through the connector, but the last of a read in the step.
    loaded = external_prompt_tokens(decode.url) - external
    assert sum(LENGTHS) - len(LENGTHS) <= loaded <= sum(LENGTHS)
    now_served = per_engine(prefill, "vllm:request_success_total")
    assert all(a > b for a, b in zip(now_served, served, strict=True)), (
        f"prefills per P engine before {served}, after {now_served}: one engine served none"
    )
    wait_kv_idle(prefill)


def test_corrupted_kv_changes_the_output(
    fleet: NamedFleet, plain_outputs: dict[Any, Generation]
) -> None:
    outputs = generate_all(fleet.routers["corrupt"].url, LENGTHS, REQUEST_TIMEOUT_S)
    differ = [n for n in LENGTHS if outputs[n].token_ids != plain_outputs[n].token_ids]
    assert len(differ) >= len(LENGTHS) - 1, f"only {differ} differ"
    wait_kv_idle(fleet.servers["p"])
