"""Prefill and decode with different TP sizes, both directions, behind the real vllm-router.

P tp 2 -> D tp 1: D's one rank reads KV head 0 from P rank 0 and head 1 from P rank 1, each
straight into its slot of D's blocks. P tp 1 -> D tp 2: each D rank reads its own head from
P's one rank, and P frees only after both D ranks said done.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq
from raw_side_channel import raw_request

from hixl_connector.connector.peers.envelope import Destination, seal_request
from hixl_connector.connector.peers.side_channel import SideChannelClient
from hixl_connector.tools.demo.client import PREFILL_LEG_PARAMS, Generation, chat, complete
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME

from ..harness import (
    CHAT_MESSAGES,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    PROMPTS,
    every_prompt_pulled,
    wait_for_pulls,
    wait_kv_idle,
)
from .conftest import AUTH_TOKEN, Fleet


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_token_identical_with_exactly_the_model_kv_pulled(
    fleet: Fleet, plain_outputs: dict[Any, Generation], p_tp: int, d_tp: int
) -> None:
    prefill = fleet.p2 if p_tp == 2 else fleet.p1
    decode = fleet.d2 if d_tp == 2 else fleet.d1
    router = fleet.launcher.router(f"router_tp{p_tp}{d_tp}", [prefill], [decode])
    read_synchronously = every_prompt_pulled(router.url, decode, plain_outputs, decode_ranks=d_tp)
    assert 1 <= read_synchronously <= len(PROMPT_LENGTHS)  # all but the first may be
    out = chat(router.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
    assert out.token_ids == plain_outputs["chat"].token_ids
    wait_kv_idle(prefill)


def test_corrupted_kv_from_two_prefill_ranks_changes_the_output(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    """D also has blocks twice P's size: the control covers both shapes' receive paths."""
    router = fleet.launcher.router("router_corrupt", [fleet.p2], [fleet.d1_corrupt])
    lengths = (64, 97, 160, 300)
    for n in lengths:
        out = complete(router.url, PROMPTS[n], model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS)
        assert out.token_ids != plain_outputs[n].token_ids, f"{n}: corruption had no effect"
    assert wait_for_pulls(fleet.d1_corrupt, len(lengths))[0] == len(lengths)


def test_a_notice_signed_for_one_prefill_rank_is_refused_by_the_other(fleet: Fleet) -> None:
    """P's two ranks share the auth token: a heartbeat captured on its way to rank 0 is
    refused by rank 1 (and by rank 0 the second time). The lease is then released on both
    ranks the way D does it, and P holds no KV afterwards."""
    leg = complete(
        fleet.p2.url,
        PROMPTS[64],
        model=SERVED_MODEL_NAME,
        max_tokens=1,
        extra={"kv_transfer_params": dict(PREFILL_LEG_PARAMS)},
    )
    params = leg.kv_transfer_params
    assert params is not None
    ranks = [
        Destination(params["remote_engine_id"], r, params["remote_incarnation"]) for r in (0, 1)
    ]
    ports = [params["remote_port"] + r for r in (0, 1)]
    lease = [params["remote_request_id"], params["remote_lease_id"]]
    context = zmq.Context()
    try:
        beat = {"type": "heartbeat", "items": [lease]}
        captured = msgpack.packb(seal_request(beat, 1, ranks[0], AUTH_TOKEN, time.time())[0])
        assert raw_request(context, ports[0], captured)["ok"]
        to_rank_one = raw_request(context, ports[1], captured)
        assert not to_rank_one["ok"]
        assert f"is for {ranks[0]}, this is {ranks[1]}" in to_rank_one["error"]
        assert "replayed request" in raw_request(context, ports[0], captured)["error"]
        for rank, port in zip(ranks, ports, strict=True):
            client = SideChannelClient(context, "127.0.0.1", port, rank, 5.0, AUTH_TOKEN)
            client.request({"type": "release", "items": [[*lease, 1, 0]]})
            client.close()
    finally:
        context.term()
    wait_kv_idle(fleet.p2)
