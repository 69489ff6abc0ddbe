"""Prefill blocks of 32 tokens, decode blocks of 64, behind the real vllm-router.

Each 64-token block of D is assembled, in place, from two 32-token blocks of P: vLLM's CPU
kernels store keys transposed inside a block, so the slices of both P blocks interleave.
The other way round (P's blocks larger) is refused before anything is read, and P frees.
"""

from __future__ import annotations

import math
from typing import Any

from hixl_connector.tools.demo.client import Generation, chat, complete
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME

from ..harness import (
    BLOCK_BYTES_PER_LAYER,
    BLOCK_SIZE,
    CHAT_MESSAGES,
    MAX_TOKENS,
    NUM_LAYERS,
    PROMPT_LENGTHS,
    PROMPTS,
    external_prompt_tokens,
    hixl_counter,
    pulled,
    request_fails,
    sync_load_requests,
    wait_for_counter,
    wait_for_pulls,
    wait_kv_idle,
)
from .conftest import Fleet


def test_smaller_prefill_blocks_are_assembled_into_decode_blocks(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    router = fleet.launcher.router("router_bs_32_64", [fleet.p1], [fleet.pd64])
    pulls, blocks, nbytes = pulled(fleet.pd64)
    external = external_prompt_tokens(fleet.pd64.url)
    sync_before = sync_load_requests(fleet.pd64, 1)
    for n in PROMPT_LENGTHS:
        out = complete(router.url, PROMPTS[n], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        assert out.token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
        now = wait_for_pulls(fleet.pd64, pulls + 1)
        assert now[0] - pulls == 1, f"{n}-token prompt: {now[0] - pulls} pulls"
        assert now[1] - blocks == math.ceil(n / (2 * BLOCK_SIZE))
        # Exactly the prompt's P blocks are read: a last D block the prompt ends in the
        # first half of takes one P block, not two.
        assert now[2] - nbytes == math.ceil(n / BLOCK_SIZE) * NUM_LAYERS * BLOCK_BYTES_PER_LAYER
        pulls, blocks, nbytes = now
    read_synchronously = sync_load_requests(fleet.pd64, 1) - sync_before
    assert 1 <= read_synchronously <= len(PROMPT_LENGTHS)  # all but the first may be
    loaded = external_prompt_tokens(fleet.pd64.url) - external
    assert loaded == sum(PROMPT_LENGTHS) - read_synchronously
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
