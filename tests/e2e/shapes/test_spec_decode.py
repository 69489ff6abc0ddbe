"""Speculative decoding with a draft model of its own KV layers, P/D behind the real
vllm-router: the draft's KV moves with the target's.

The draft is the tiny model itself (vLLM's ``draft_model`` method), so a draft that sees the
prompt's KV guesses every token the target will pick. Greedy outputs cannot show a lost
draft (the target decides every token whatever the draft proposes); its acceptance can.

The oracle is vLLM's own NixlConnector running P/D of the same spec config on the same
prompts: the same outputs and exactly the same proposed and accepted draft tokens. (A plain
server accepts one draft more per request: its prefill step proposes from the prompt, while
a P/D decoder's first step proposes before its draft has computed the last prompt token,
for either connector.) Beside it: the draft's layers are counted in every block D reads, and
the control corrupts only the draft's layers as D receives them: outputs stay the same and
acceptance collapses.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl_connector.tools.bench_serve import NIXL_CONFIG
from hixl_connector.tools.demo.client import metric_total, read_metrics
from hixl_connector.tools.demo.servers import RouterProcess, VllmServer

from ..harness import (
    BLOCK_SIZE,
    NamedFleet,
    PDLauncher,
    ProcessRegistry,
    pulled,
    settled,
    token_prompt,
    wait_for_pulls,
    wait_kv_idle,
)
from .conftest import hixl_connector_config
from .named_fleets import greedy, serve_named_fleet, start_named

SPECULATIVE_TOKENS = 3
MAX_TOKENS = 24
# A block on each rank: K and V of 2 heads x 32 dims x 32 tokens, fp32, per layer; the
# tiny model's 2 layers and its draft's 2.
LAYER_BLOCK_BYTES = 2 * 2 * 32 * BLOCK_SIZE * 4
TARGET_AND_DRAFT_LAYERS = 2 + 2
# 64 fills its blocks exactly: a read in the step then gets a lookahead block past the prompt.
LENGTHS = (5, 32, 64, 97, 150)
PROMPTS = {n: token_prompt(n, seed=4000 + n) for n in LENGTHS}
# The draft's layers: vLLM names them under the drafter's model.
DRAFT_LAYERS = "draft_model."


@pytest.fixture(scope="module")
def fleet(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[NamedFleet]:
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("the speculative-decoding oracle needs NIXL (bash .ci/setup installs it)")
    speculative = {
        "method": "draft_model",
        "model": str(tiny_model_dir),
        "num_speculative_tokens": SPECULATIVE_TOKENS,
    }
    args = ["--speculative-config", json.dumps(speculative)]
    launcher = PDLauncher(tiny_model_dir, e2e_log_dir / "spec_decode", process_registry)

    def start_servers() -> dict[str, VllmServer]:
        configs = {
            "p_hixl": hixl_connector_config("prefill"),
            "d_hixl": hixl_connector_config("decode"),
            "d_draft_corrupt": hixl_connector_config(
                "decode", test_corrupt_received_kv=DRAFT_LAYERS
            ),
            "p_nixl": NIXL_CONFIG,
            "d_nixl": NIXL_CONFIG,
        }
        return start_named(launcher, configs, args)

    pairs = {
        "hixl": ("p_hixl", "d_hixl"),
        "draft_corrupt": ("p_hixl", "d_draft_corrupt"),
        "nixl": ("p_nixl", "d_nixl"),
    }
    yield from serve_named_fleet(launcher, start_servers, pairs)


def generate(router: RouterProcess, n: int) -> list[int]:
    return greedy(router.url, PROMPTS[n], MAX_TOKENS)


def drafts(server: VllmServer) -> tuple[float, float]:
    """(draft tokens proposed, draft tokens accepted) on a server so far."""
    samples = read_metrics(server.url)
    return (
        metric_total(samples, "vllm:spec_decode_num_draft_tokens_total"),
        metric_total(samples, "vllm:spec_decode_num_accepted_tokens_total"),
    )


def drafts_for(fleet: NamedFleet, pair: str, decode: str) -> tuple[dict[int, list[int]], tuple]:
    """Outputs of every prompt through ``pair``, and the draft tokens its D proposed and
    accepted for them (vLLM reports a step's counts with the step's outputs; settled anyway)."""
    server = fleet.servers[decode]
    before = drafts(server)
    outputs = {n: generate(fleet.routers[pair], n) for n in LENGTHS}
    # Every request ran at least one verifying step past the first token.
    after = settled(lambda: drafts(server), lambda now: now[0] - before[0] >= len(LENGTHS))
    return outputs, (after[0] - before[0], after[1] - before[1])


def test_the_draft_kv_moves_with_the_target_kv(fleet: NamedFleet) -> None:
    decode = fleet.servers["d_hixl"]
    reference, (oracle_proposed, oracle_accepted) = drafts_for(fleet, "nixl", "d_nixl")
    # The draft is the model itself: it guesses right almost always when it sees the prompt.
    assert oracle_accepted >= 0.8 * oracle_proposed > 0
    pulls, blocks, nbytes = pulled(decode)
    outputs, (proposed, accepted) = drafts_for(fleet, "hixl", "d_hixl")
    assert outputs == reference
    assert (proposed, accepted) == (oracle_proposed, oracle_accepted)
    now = wait_for_pulls(decode, pulls + len(LENGTHS))
    # Only the prompt's blocks, though a read in the step is allocated lookahead slots past it.
    expected_blocks = sum(math.ceil(n / BLOCK_SIZE) for n in LENGTHS)
    assert now[1] - blocks == expected_blocks
    assert now[2] - nbytes == expected_blocks * TARGET_AND_DRAFT_LAYERS * LAYER_BLOCK_BYTES
    wait_kv_idle(fleet.servers["p_hixl"])


def test_a_corrupted_draft_kv_keeps_the_output_and_loses_acceptance(fleet: NamedFleet) -> None:
    reference, (_, oracle_accepted) = drafts_for(fleet, "nixl", "d_nixl")
    outputs, (proposed, accepted) = drafts_for(fleet, "draft_corrupt", "d_draft_corrupt")
    # The target's KV arrived intact: greedy decoding picks the same tokens.
    assert outputs == reference
    assert proposed > 0
    assert accepted < 0.5 * oracle_accepted, (accepted, oracle_accepted)
    wait_kv_idle(fleet.servers["p_hixl"])
