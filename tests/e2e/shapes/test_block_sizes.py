"""Prefill blocks of 32 tokens, decode blocks of 64, behind the real vllm-router.

Each 64-token block of D is assembled, in place, from two 32-token blocks of P: vLLM's CPU
kernels store keys transposed inside a block, so the slices of both P blocks interleave.
The other way round (P's blocks larger) is refused before anything is read, and P frees.
"""

from __future__ import annotations

from typing import Any

from hixl_connector.tools.demo.client import Generation, chat
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME

from ..harness import (
    BLOCK_SIZE,
    CHAT_MESSAGES,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    PROMPTS,
    every_prompt_pulled,
    hixl_counter,
    pulled,
    request_fails,
    wait_for_counter,
    wait_kv_idle,
)
from .conftest import Fleet


def test_smaller_prefill_blocks_are_assembled_into_decode_blocks(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    router = fleet.launcher.router("router_bs_32_64", [fleet.p1], [fleet.pd64])
    read_synchronously = every_prompt_pulled(
        router.url, fleet.pd64, plain_outputs, decode_block_size=2 * BLOCK_SIZE
    )
    assert 1 <= read_synchronously <= len(PROMPT_LENGTHS)  # all but the first may be
    out = chat(router.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    assert out.token_ids == plain_outputs["chat"].token_ids
    wait_kv_idle(fleet.p1)


def test_larger_prefill_blocks_are_refused_naming_both_sizes(fleet: Fleet) -> None:
    router = fleet.launcher.router("router_bs_64_32", [fleet.pd64], [fleet.d1])
    refused = hixl_counter(fleet.d1, "invalid_requests")
    pulls = pulled(fleet.d1)[0]
    assert request_fails(router.url, PROMPTS[97]), "D decoded on blocks of another size"
    assert "prefill block_size [64], decode block_size [32]" in fleet.d1.log_tail(200)
    assert wait_for_counter(fleet.d1, "invalid_requests", refused + 1) == refused + 1
    assert pulled(fleet.d1)[0] == pulls
    wait_kv_idle(fleet.pd64)  # D told P to free at once
