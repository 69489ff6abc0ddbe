"""Push mode (``transfer_mode: "push"``) behind the unchanged vllm-router.

P answers with its push identity, so vllm-router sends D only P's address (engine id, host,
port): D grants P its blocks and registers them with P, and P writes the KV there. The first
request to P runs sequentially (D hears of it after P finished); from then on the router
sends P and D at once. "Works" means: outputs
token-identical to a plain server at concurrency 4, D's counters show the requests were
pushed (not pulled, not computed), and corrupting what P wrote changes the output.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import Generation, complete
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, VllmServer

from .harness import (
    BLOCK_BYTES_PER_LAYER,
    BLOCK_SIZE,
    MAX_TOKENS,
    NUM_LAYERS,
    PROMPT_LENGTHS,
    PROMPTS,
    NamedFleet,
    PDDeployment,
    PDLauncher,
    ProcessRegistry,
    hixl_connector_config,
    hixl_counter,
    make_prompt,
    pulled,
    request_fails,
    token_prompt,
    wait_for_counter,
    wait_for_pulls,
    wait_kv_idle,
)

PUSH: dict[str, Any] = {"transfer_mode": "push"}
CONCURRENCY = 4


def _start(launcher: PDLauncher, **decode_extra: Any) -> PDDeployment:
    return launcher.start(
        hixl_connector_config("prefill", **PUSH),
        hixl_connector_config("decode", **PUSH, **decode_extra),
    )


def _complete_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of ``prompts``, CONCURRENCY at a time."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [
            pool.submit(complete, url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
            for prompt in prompts
        ]
        return [f.result(timeout=300).token_ids for f in futures]


def _fresh_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts no server has seen (no prefix-cache hit anywhere)."""
    return [token_prompt(n, seed + i) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def deployment(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[PDDeployment]:
    with PDLauncher(tiny_model_dir, e2e_log_dir / "push", process_registry) as launcher:
        yield _start(launcher)


def test_p_pushes_first_after_then_while_it_prefills_token_identical(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation], plain_server: VllmServer
) -> None:
    decode, prefill = deployment.decode, deployment.prefill
    # The first request to P is sequential: D hears of it only once P answered (with its
    # push identity), registers its blocks then, and P pushes what it already holds.
    first = complete(deployment.url, PROMPTS[97], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    assert first.token_ids == plain_outputs[97].token_ids
    assert wait_for_counter(decode, "push_receives", 1) == 1
    assert hixl_counter(prefill, "early_push_registrations") == 0
    assert hixl_counter(prefill, "layered_pushes") == 0  # D registered after the forward
    wait_kv_idle(prefill)

    # Then the router sends P and D at once: D registers while P still prefills.
    lengths = [n for _ in range(2) for n in PROMPT_LENGTHS]
    prompts = _fresh_prompts(lengths, seed=1000)
    expected = _complete_all(plain_server.url, prompts)
    receives, blocks, nbytes = pulled(decode)
    outputs = _complete_all(deployment.url, prompts)
    for i, n in enumerate(lengths):
        assert outputs[i] == expected[i], f"request {i} ({n} tokens) differs"
    pushed = wait_for_counter(decode, "push_receives", 1 + len(lengths))
    assert pushed == 1 + len(lengths), f"{pushed - 1} of {len(lengths)} requests were pushed"
    assert hixl_counter(prefill, "early_push_registrations") >= 1
    # Some Ds registered while P's forward computed their prompt: P wrote those layer by layer.
    layered = hixl_counter(prefill, "layered_pushes")
    print(f"layered pushes: {layered} of {len(lengths)}")
    assert layered >= 1
    now = wait_for_pulls(decode, receives + len(lengths))
    expected_blocks = sum(math.ceil(n / BLOCK_SIZE) for n in lengths)
    assert now[1] - blocks == expected_blocks
    assert now[2] - nbytes == expected_blocks * NUM_LAYERS * BLOCK_BYTES_PER_LAYER
    assert wait_for_counter(prefill, "pushes", 1 + len(lengths)) == 1 + len(lengths)
    for counter in ("failed_pushes", "failed_push_receives", "push_timeouts"):
        assert hixl_counter(decode, counter) + hixl_counter(prefill, counter) == 0, counter
    wait_kv_idle(prefill)  # P freed every pushed request's blocks


def test_corrupted_pushed_kv_changes_the_output(
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
    plain_server: VllmServer,
) -> None:
    """The control: D overwrites what P wrote with noise before vLLM uses it."""
    with PDLauncher(tiny_model_dir, e2e_log_dir / "push_corrupt", process_registry) as launcher:
        pd = _start(launcher, test_corrupt_received_kv=True)
        complete(pd.url, PROMPTS[64], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        lengths = [97, 160, 230, 300]
        prompts = _fresh_prompts(lengths, seed=2000)
        expected = _complete_all(plain_server.url, prompts)
        outputs = _complete_all(pd.url, prompts)
        for i, n in enumerate(lengths):
            assert outputs[i] != expected[i], f"{n}: corruption had no effect"
        # Every request was pushed (the first too) and fed the corrupted KV to the model.
        pushed = wait_for_counter(pd.decode, "push_receives", 1 + len(lengths))
        assert pushed == 1 + len(lengths)


@pytest.fixture(scope="module")
def shapes(
    deployment: PDDeployment,
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
) -> Iterator[NamedFleet]:
    """Push mode across the shapes pull reads: P's blocks of 32 tokens into D's of 64, TP 2
    into 1 and 1 into 2, and P's blocks larger than D's (refused); all started at once."""
    with PDLauncher(tiny_model_dir, e2e_log_dir / "push_shapes", process_registry) as launcher:
        decode = hixl_connector_config("decode", **PUSH)
        corrupt = hixl_connector_config("decode", **PUSH, test_corrupt_received_kv=True)
        servers = {
            "p": deployment.prefill,
            "d": deployment.decode,
            "d64": launcher.server("d64", decode, block_size=64),
            "d64_corrupt": launcher.server("d64_corrupt", corrupt, block_size=64),
            # D refuses its pushes, so its blocks wait for the lease to end: a short one.
            "p64": launcher.server(
                "p64", hixl_connector_config("prefill", **PUSH, lease_s=5.0), block_size=64
            ),
            "p2": launcher.server("p2", hixl_connector_config("prefill", 2, **PUSH), tp=2),
            # A TP-2 server's workers busy-step while they await pushes, and once starved
            # d2's first-contact handshake past the default 5 s on this 2-core host (each
            # server was in an autogroup of its own then, so nice did not help): given 30 s,
            # as the data-parallel D is.
            "d2": launcher.server(
                "d2",
                hixl_connector_config("decode", 2, **PUSH, handshake_timeout_s=30.0),
                tp=2,
            ),
        }
        pairs = {
            "32_64": ("p", "d64"),
            "64_32": ("p64", "d"),
            "tp21": ("p2", "d"),
            "tp12": ("p", "d2"),
            # The control covers both shapes: P's two ranks write the slices of their heads.
            "corrupt": ("p2", "d64_corrupt"),
        }
        yield NamedFleet(servers, launcher.pairs(servers, pairs))


def test_smaller_prefill_blocks_are_pushed_into_decode_blocks(
    shapes: NamedFleet, plain_server: VllmServer
) -> None:
    """P's 32-token blocks into D's 64-token blocks: P writes the slices of each KV head of
    two of its blocks straight into their places in one of D's (vLLM's CPU kernels lay a
    block out by its size)."""
    prefill, d64 = shapes.servers["p"], shapes.servers["d64"]
    lengths = [n for _ in range(2) for n in PROMPT_LENGTHS]
    prompts = _fresh_prompts(lengths, seed=3000)
    expected = _complete_all(plain_server.url, prompts)
    layered = hixl_counter(prefill, "layered_pushes")
    outputs = _complete_all(shapes.routers["32_64"].url, prompts)
    for i, n in enumerate(lengths):
        assert outputs[i] == expected[i], f"request {i} ({n} tokens) differs"
    assert wait_for_counter(d64, "push_receives", len(lengths)) == len(lengths)
    assert pulled(d64)[1] == sum(math.ceil(n / 64) for n in lengths)
    assert hixl_counter(prefill, "layered_pushes") > layered
    for counter in ("failed_push_receives", "push_timeouts"):
        assert hixl_counter(d64, counter) == 0, counter
    wait_kv_idle(prefill)


def test_larger_prefill_blocks_are_refused_naming_both_sizes(shapes: NamedFleet) -> None:
    decode = shapes.servers["d"]
    failed = hixl_counter(decode, "failed_push_receives")
    assert request_fails(shapes.routers["64_32"].url, make_prompt(7, 60)), (
        "D decoded on blocks of another size"
    )
    assert "prefill block_size [64], decode block_size [32]" in decode.log_tail(200)
    assert hixl_counter(decode, "failed_push_receives") == failed + 1
    wait_kv_idle(shapes.servers["p64"])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_tp_sizes_differ_each_p_rank_pushes_the_heads_it_holds(
    shapes: NamedFleet, plain_server: VllmServer, p_tp: int, d_tp: int
) -> None:
    """TP 2 into 1: D's rank registers with both P ranks, each writes its KV head into D's
    blocks and its own word. TP 1 into 2: both D ranks register with P's one rank, which
    writes each its head and frees once both were pushed."""
    prefill = shapes.servers["p2" if p_tp == 2 else "p"]
    decode = shapes.servers["d2" if d_tp == 2 else "d"]
    lengths = [n for _ in range(2) for n in PROMPT_LENGTHS]
    prompts = _fresh_prompts(lengths, seed=4000 + 10 * p_tp)
    expected = _complete_all(plain_server.url, prompts)
    receives, blocks, _ = pulled(decode)
    failed = {c: hixl_counter(decode, c) for c in ("failed_push_receives", "push_timeouts")}
    outputs = _complete_all(shapes.routers[f"tp{p_tp}{d_tp}"].url, prompts)
    for i, n in enumerate(lengths):
        assert outputs[i] == expected[i], f"request {i} ({n} tokens) differs"
    # Every D rank takes every request (its heads of the blocks).
    now = wait_for_pulls(decode, receives + d_tp * len(lengths))
    assert now[0] - receives == d_tp * len(lengths)
    assert now[1] - blocks == d_tp * sum(math.ceil(n / BLOCK_SIZE) for n in lengths)
    for counter, before in failed.items():
        assert hixl_counter(decode, counter) == before, counter
    wait_kv_idle(prefill)  # every P rank freed once each of its Ds was pushed


def test_corrupted_kv_from_two_prefill_ranks_into_larger_blocks_changes_the_output(
    shapes: NamedFleet, plain_server: VllmServer
) -> None:
    lengths = [97, 160, 230, 300]
    prompts = _fresh_prompts(lengths, seed=5000)
    expected = _complete_all(plain_server.url, prompts)
    outputs = _complete_all(shapes.routers["corrupt"].url, prompts)
    for i, n in enumerate(lengths):
        assert outputs[i] != expected[i], f"{n}: corruption had no effect"
    corrupt = shapes.servers["d64_corrupt"]
    assert wait_for_counter(corrupt, "push_receives", len(lengths)) == len(lengths)
    wait_kv_idle(shapes.servers["p2"])
