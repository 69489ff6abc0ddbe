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
    launcher = PDLauncher(tiny_model_dir, e2e_log_dir / "push", process_registry)
    try:
        yield _start(launcher)
    finally:
        launcher.stop_all()


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
    launcher = PDLauncher(tiny_model_dir, e2e_log_dir / "push_corrupt", process_registry)
    try:
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
    finally:
        launcher.stop_all()


def test_smaller_prefill_blocks_are_pushed_into_decode_blocks(
    deployment: PDDeployment,
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
    plain_server: VllmServer,
) -> None:
    """P's 32-token blocks into D's 64-token blocks: P writes the slices of each KV head of
    two of its blocks straight into their places in one of D's (vLLM's CPU kernels lay a
    block out by its size); the control corrupts what P wrote. P's blocks larger than D's
    are refused, naming both sizes."""
    prefill = deployment.prefill
    launcher = PDLauncher(tiny_model_dir, e2e_log_dir / "push_blocks", process_registry)
    try:
        d64 = launcher.server("d64", hixl_connector_config("decode", **PUSH), block_size=64)
        d64_corrupt = launcher.server(
            "d64_corrupt",
            hixl_connector_config("decode", **PUSH, test_corrupt_received_kv=True),
            block_size=64,
        )
        # D refuses the push, so P's blocks wait for the end of the lease: a short one.
        p64 = launcher.server(
            "p64", hixl_connector_config("prefill", **PUSH, lease_s=5.0), block_size=64
        )
        servers = {"p": prefill, "d": deployment.decode, "p64": p64, "d64": d64}
        servers["d64_corrupt"] = d64_corrupt
        routers = launcher.pairs(
            servers,
            {"32_64": ("p", "d64"), "corrupt": ("p", "d64_corrupt"), "64_32": ("p64", "d")},
        )

        lengths = [n for _ in range(2) for n in PROMPT_LENGTHS]
        prompts = _fresh_prompts(lengths, seed=3000)
        expected = _complete_all(plain_server.url, prompts)
        layered = hixl_counter(prefill, "layered_pushes")
        # The router's first request to P runs alone (it learns P's push identity), the
        # rest go to P and D at once.
        outputs = _complete_all(routers["32_64"].url, prompts)
        for i, n in enumerate(lengths):
            assert outputs[i] == expected[i], f"request {i} ({n} tokens) differs"
        assert wait_for_counter(d64, "push_receives", len(lengths)) == len(lengths)
        assert pulled(d64)[1] == sum(math.ceil(n / 64) for n in lengths)
        assert hixl_counter(prefill, "layered_pushes") > layered
        for counter in ("failed_push_receives", "push_timeouts"):
            assert hixl_counter(d64, counter) == 0, counter
        wait_kv_idle(prefill)

        outputs = _complete_all(routers["corrupt"].url, prompts)
        differ = [n for i, n in enumerate(lengths) if outputs[i] != expected[i]]
        assert len(differ) == len(lengths), (
            f"corruption had no effect on {len(lengths) - len(differ)}"
        )
        assert wait_for_counter(d64_corrupt, "push_receives", len(lengths)) == len(lengths)
        wait_kv_idle(prefill)

        failed = hixl_counter(deployment.decode, "failed_push_receives")
        assert request_fails(routers["64_32"].url, make_prompt(7, 60)), (
            "D decoded on blocks of another size"
        )
        assert "prefill block_size [64], decode block_size [32]" in deployment.decode.log_tail(200)
        assert hixl_counter(deployment.decode, "failed_push_receives") == failed + 1
        wait_kv_idle(p64)
    finally:
        launcher.stop_all()
