"""Multi-head latent attention (DeepSeek-V2 style, vLLM's CPU MLA backend) P/D behind the
real vllm-router.

The oracle is another connector, vLLM's own NixlConnector, running P/D on the same prompts;
not a plain server: with MLA, D computes the last prompt token by MLA's decode path (reading
the latent cache) and a plain server by its prefill path, which differ in the last bits, and
the tiny random model amplifies that into other tokens. (vLLM's ExampleConnector, which needs
no extra package, saves and loads no KV with vLLM's CPU MLA backend.) Beside it: every prompt
token the connector should move counted by vLLM on D, exactly the latent's bytes read, and
the corrupted-KV control changing the outputs.

P with TP 2 and D with TP 1: every rank of P holds the whole latent, and D reads one
replica. No output oracle exists here (a TP-2 prefill rounds differently from a TP-1 one,
and a NIXL TP-2 server starves a 2-core host), so the check is on the bytes: the test
connector logs a digest of each request's prompt blocks on every P rank, as P's forward left
them, and on D, as they landed (before the control overwrites them); they must be equal.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hixl_test_connector import DIGEST_LOG

from hixl_connector.tools.bench_serve import NIXL_CONFIG
from hixl_connector.tools.demo.servers import RouterProcess, VllmServer
from hixl_connector.tools.demo.tiny_model import MLA_KV_LORA_RANK, MLA_ROPE_DIM, build_tiny_model

from ..harness import (
    MAX_TOKENS,
    NamedFleet,
    PDLauncher,
    ProcessRegistry,
    external_prompt_tokens,
    hixl_connector_config,
    pulled,
    token_prompt,
    wait_for_pulls,
    wait_kv_idle,
)
from .named_fleets import greedy, nixl_env, serve_named_fleet

# vLLM's CPU platform serves MLA with 16-token blocks only.
MLA_BLOCK_SIZE = 16
# Where the CPU has AMX tiles vLLM picks its AMX MLA backend, which takes bf16 or fp16
# weights only (the tiny model is fp32): the CPU MLA backend is named on every host.
MLA_BACKEND_ARGS = ("--attention-backend", "CPU_MLA")
NUM_LAYERS = 3
# Per block and layer: one latent "head" of 512 + 64 rotary dims, fp32.
BLOCK_BYTES_PER_LAYER = MLA_BLOCK_SIZE * (MLA_KV_LORA_RANK + MLA_ROPE_DIM) * 4
LENGTHS = (5, 16, 17, 64, 97, 160, 230)
PROMPTS = {n: token_prompt(n, seed=2000 + n) for n in LENGTHS}


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[NamedFleet]:
    model = build_tiny_model(tmp_path_factory.mktemp("deepseek_v2") / "model", "deepseek-v2")
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("the MLA oracle needs NIXL (bash .ci/setup installs it)")
    launcher = PDLauncher(model, e2e_log_dir / "mla", process_registry)

    def start_servers() -> dict[str, VllmServer]:
        corrupt = hixl_connector_config(
            "decode", test_corrupt_received_kv=True, test_log_kv_digests=True
        )
        configs = {
            "p_hixl": hixl_connector_config("prefill"),
            "d_hixl": hixl_connector_config("decode"),
            "d_corrupt": corrupt,
            "p_nixl": NIXL_CONFIG,
            "d_nixl": NIXL_CONFIG,
            "p_tp2": hixl_connector_config("prefill", ranks=2, test_log_kv_digests=True),
        }
        return {
            name: launcher.server(
                name,
                config,
                tp=2 if name == "p_tp2" else 1,
                args=MLA_BACKEND_ARGS,
                block_size=MLA_BLOCK_SIZE,
                env=nixl_env(name),
            )
            for name, config in configs.items()
        }

    pairs = {
        "hixl": ("p_hixl", "d_hixl"),
        "corrupt": ("p_hixl", "d_corrupt"),
        "nixl": ("p_nixl", "d_nixl"),
        "tp2": ("p_tp2", "d_corrupt"),
    }
    yield from serve_named_fleet(launcher, start_servers, pairs)


def generate(router: RouterProcess, n: int) -> list[int]:
    return greedy(router.url, PROMPTS[n], MAX_TOKENS)


def test_the_model_runs_on_the_mla_backend(fleet: NamedFleet) -> None:
    log = fleet.servers["d_hixl"].log_path.read_text(errors="replace")
    assert "MLA" in log, "the decode server did not select an MLA attention backend"


def test_token_identical_to_nixl_with_the_latent_read(fleet: NamedFleet) -> None:
    decode = fleet.servers["d_hixl"]
    oracle_loaded = external_prompt_tokens(fleet.servers["d_nixl"].url)
    reference = {n: generate(fleet.routers["nixl"], n) for n in LENGTHS}
    # The oracle is P/D itself: NIXL's D loaded the prompts rather than computing them.
    assert external_prompt_tokens(fleet.servers["d_nixl"].url) - oracle_loaded >= sum(LENGTHS) / 2
    # Varied outputs: the random weights do not collapse to one repeated token.
    assert all(len(set(tokens)) >= MAX_TOKENS // 5 for tokens in reference.values())
    pulls, blocks, nbytes = pulled(decode)
    external = external_prompt_tokens(decode.url)
    for n in LENGTHS:
        assert generate(fleet.routers["hixl"], n) == reference[n], f"{n}-token prompt differs"
        now = wait_for_pulls(decode, pulls + 1)
        expected_blocks = math.ceil(n / MLA_BLOCK_SIZE)
        assert now[1] - blocks == expected_blocks, f"{n}-token prompt: wrong block count"
        assert now[2] - nbytes == expected_blocks * NUM_LAYERS * BLOCK_BYTES_PER_LAYER
        pulls, blocks, nbytes = now
    # vLLM's own count of prompt tokens that came through the connector: every one, but the
    # last of a read in the step of the first token, which that step computes.
    loaded = external_prompt_tokens(decode.url) - external
    assert sum(LENGTHS) - len(LENGTHS) <= loaded <= sum(LENGTHS)
    wait_kv_idle(fleet.servers["p_hixl"])


def test_corrupted_latent_changes_the_output(fleet: NamedFleet) -> None:
    decode = fleet.servers["d_corrupt"]
    pulls = pulled(decode)[0]
    for n in (64, 160, 230):
        assert generate(fleet.routers["corrupt"], n) != generate(fleet.routers["nixl"], n), n
    assert wait_for_pulls(decode, pulls + 3)[0] == pulls + 3


DIGEST_LINE = re.compile(DIGEST_LOG.replace("%s", r"(\S+)").replace("%d", r"(\d+)"))


def digests(server_log: Path, side: str) -> dict[str, dict[int, tuple[int, str]]]:
    """{P's request id: {rank: (blocks, sha256)}} a server's log holds for ``side``."""
    found: dict[str, dict[int, tuple[int, str]]] = {}
    for match in DIGEST_LINE.finditer(server_log.read_text(errors="replace")):
        logged_side, request, rank, blocks, sha = match.groups()
        if logged_side == side:
            found.setdefault(request, {})[int(rank)] = (int(blocks), sha)
    return found


def test_a_tp1_decoder_reads_one_replica_of_a_tp2_prefill_byte_for_byte(
    fleet: NamedFleet,
) -> None:
    prefill, decode = fleet.servers["p_tp2"], fleet.servers["d_corrupt"]
    pulls = pulled(decode)[0]
    for n in LENGTHS:
        generate(fleet.routers["tp2"], n)
    wait_for_pulls(decode, pulls + len(LENGTHS))
    wait_kv_idle(prefill)
    prefilled = digests(prefill.log_path, "prefill")
    received = digests(decode.log_path, "decode")
    assert len(prefilled) == len(LENGTHS), f"P logged {len(prefilled)} requests"
    for request, ranks in prefilled.items():
        assert sorted(ranks) == [0, 1], f"{request}: digests of P ranks {sorted(ranks)}"
        # MLA keeps the same latent on every rank: both replicas hold the same bytes.
        assert ranks[0] == ranks[1], f"{request}: P's replicas differ"
        assert received.get(request) == {0: ranks[0]}, f"{request}: D received other bytes"
