"""HixlConnector with real vLLM CPU servers behind the real vllm-router.

"Works" means: D's greedy output is token-identical to a plain single-instance run, D's own
metrics show the blocks and bytes it pulled, and corrupting the pulled KV changes the output
(so the identity cannot come from a silent local recompute).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import (
    Generation,
    chat,
    complete,
    metric_total,
    read_metrics,
)
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME

from .harness import (
    BLOCK_SIZE,
    CHAT_MESSAGES,
    MAX_TOKENS,
    PROMPTS,
    PDDeployment,
    PDLauncher,
    ProcessRegistry,
    every_prompt_pulled,
    hixl_connector_config,
    hixl_counter,
    pulled,
    settled,
    wait_for_counter,
    wait_for_pulls,
)


@pytest.fixture(scope="module")
def deployment(
    tiny_model_dir: Path, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[PDDeployment]:
    with PDLauncher(tiny_model_dir, e2e_log_dir / "hixl", process_registry) as launcher:
        yield launcher.start(hixl_connector_config("prefill"), hixl_connector_config("decode"))


def test_completions_token_identical_and_blocks_pulled(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation]
) -> None:
    # After the first read from P links it, every one of these small reads lands in the step
    # that computes the request's first token.
    read_synchronously = every_prompt_pulled(deployment.url, deployment.decode, plain_outputs)
    assert 1 <= read_synchronously <= len(PROMPTS) - 1
    # The counter's name before its rename still counts the same reads (CHANGELOG.md).
    assert hixl_counter(deployment.decode, "in_step_loads") == hixl_counter(
        deployment.decode, "sync_loads"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_and_streaming_token_identical(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation], stream: bool
) -> None:
    before = pulled(deployment.decode)[0]
    out = chat(
        deployment.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=stream
    )
    assert out.token_ids == plain_outputs["chat"].token_ids
    prompt = PROMPTS[230]
    out = complete(
        deployment.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=stream
    )
    assert out.token_ids == plain_outputs[230].token_ids
    assert wait_for_pulls(deployment.decode, before + 2)[0] >= before + 2


def test_repeated_prompt_hits_decode_prefix_cache(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation]
) -> None:
    prompt = PROMPTS[300] + PROMPTS[97][:20]  # extends a prompt D already holds
    first = complete(deployment.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    pulls, blocks, _ = wait_for_pulls(deployment.decode, pulled(deployment.decode)[0])
    again = complete(deployment.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    assert again.token_ids == first.token_ids
    now = wait_for_pulls(deployment.decode, pulls + 1)
    # D already holds every full block but the last one it must recompute into.
    assert now[0] == pulls + 1
    assert 0 < now[1] - blocks < math.ceil(len(prompt) / BLOCK_SIZE)


def test_concurrent_requests(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation]
) -> None:
    lengths = (64, 97, 160, 230, 300, 129)
    with ThreadPoolExecutor(len(lengths)) as pool:
        futures = {
            n: pool.submit(
                complete, deployment.url, PROMPTS[n], model=SERVED_MODEL_NAME, max_tokens=64
            )
            for n in lengths
        }
        outputs = {n: f.result(timeout=120) for n, f in futures.items()}
    for n in lengths:
        assert outputs[n].token_ids[:MAX_TOKENS] == plain_outputs[n].token_ids


def test_corrupted_kv_changes_the_output(
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
    plain_outputs: dict[Any, Generation],
) -> None:
    """The control: same P/D, but D overwrites the pulled blocks with noise before decoding.

    Also loads P's connector by its registered name alone (the vLLM plugin entry point).
    """
    decode = hixl_connector_config("decode", test_corrupt_received_kv=True)
    prefill = hixl_connector_config("prefill")
    del prefill["kv_connector_module_path"]
    with PDLauncher(tiny_model_dir, e2e_log_dir / "corrupt", process_registry) as launcher:
        pd = launcher.start(prefill, decode)
        lengths = (64, 97, 160, 300)
        for n in lengths:
            out = complete(pd.url, PROMPTS[n], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
            assert out.token_ids != plain_outputs[n].token_ids, f"{n}: corruption had no effect"
        assert wait_for_pulls(pd.decode, len(lengths))[0] == len(lengths)
        # Reads in the step and asynchronous ones alike fed the corrupted KV to the model.
        assert wait_for_counter(pd.decode, "sync_loads", 1) >= 1


def test_a_request_that_reaches_decode_without_params_is_counted_and_named(
    deployment: PDDeployment, plain_outputs: dict[Any, Generation]
) -> None:
    """A gateway that sends a prompt straight to D (or drops P's params) makes D compute it
    itself: the answer is right, and D's metrics and log say it happened."""
    decode = deployment.decode

    def counted() -> float:
        return metric_total(
            read_metrics(decode.url),
            "vllm:hixl_misconfigured_requests_total",
            kind="decode_without_params",
        )

    before = counted()
    out = complete(decode.url, PROMPTS[97], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    assert out.token_ids == plain_outputs[97].token_ids
    assert settled(counted, lambda value: value >= before + 1) == before + 1
    assert "without kv_transfer_params" in decode.log_path.read_text(errors="replace")
