"""Several prefill instances serving one decode instance, the reverse, and two prefill
instances serving three decode instances, behind vllm-router.

The fleet mixes TP sizes and block sizes on purpose: P tp 1 and P tp 2 feed one D, one P
feeds D tp 1 and D tp 2, and in 2P x 3D the third D has 64-token blocks, so each D handshakes
with (and each P leases to) peers of more than one shape.
"""

from __future__ import annotations

from typing import Any

from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    Generation,
    complete,
    metric_total,
    read_metrics,
)
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, VllmServer

from ..harness import (
    PROMPTS,
    generate_all,
    hixl_counter,
    pulled,
    request_fails,
    wait_for_counter,
    wait_for_pulls,
    wait_kv_idle,
)
from .conftest import Fleet

LENGTHS = (64, 97, 129, 160, 230, 300)


def served(server: VllmServer) -> float:
    return metric_total(read_metrics(server.url), "vllm:request_success_total")


def test_two_prefill_instances_serve_one_decode(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    router = fleet.launcher.router("router_2p1d", [fleet.p1, fleet.p2], [fleet.d1])
    before = {p.name: served(p) for p in (fleet.p1, fleet.p2)}
    pulls = pulled(fleet.d1)[0]
    outputs = generate_all(router.url, LENGTHS, 120)
    for n in LENGTHS:
        assert outputs[n].token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
    for prefill in (fleet.p1, fleet.p2):
        assert served(prefill) > before[prefill.name], f"{prefill.name} served no prefill"
        wait_kv_idle(prefill)
    assert wait_for_pulls(fleet.d1, pulls + len(LENGTHS))[0] == pulls + len(LENGTHS)


def test_one_prefill_instance_serves_two_decodes(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    router = fleet.launcher.router("router_1p2d", [fleet.p1], [fleet.d1, fleet.d2])
    before = {d.name: pulled(d)[0] for d in (fleet.d1, fleet.d2)}
    outputs = generate_all(router.url, LENGTHS, 120)
    for n in LENGTHS:
        assert outputs[n].token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
    for decode in (fleet.d1, fleet.d2):
        assert wait_for_pulls(decode, before[decode.name] + 1)[0] > before[decode.name]
    wait_kv_idle(fleet.p1)


def test_two_prefill_instances_serve_three_decodes(
    fleet: Fleet, plain_outputs: dict[Any, Generation]
) -> None:
    """2P x 3D: the router's round robin sends each P three of the six prompts and each D
    two; every output is token-identical, every instance does its part, and every P's KV
    cache is back to empty."""
    prefills, decodes = [fleet.p1, fleet.p2], [fleet.d1, fleet.d2, fleet.pd64]
    router = fleet.launcher.router("router_2p3d", prefills, decodes)
    served_before = {p.name: served(p) for p in prefills}
    pulls_before = {d.name: pulled(d)[0] for d in decodes}
    outputs = generate_all(router.url, LENGTHS, 120)
    for n in LENGTHS:
        assert outputs[n].token_ids == plain_outputs[n].token_ids, f"{n}-token prompt differs"
    for prefill in prefills:
        assert served(prefill) > served_before[prefill.name], f"{prefill.name} served nothing"
        wait_kv_idle(prefill)
    for decode in decodes:
        before = pulls_before[decode.name]
        assert wait_for_pulls(decode, before + 1)[0] > before, f"{decode.name} read nothing"


def test_tp_sizes_that_cannot_map_fail_the_request_and_free_the_prefill(
    fleet: Fleet,
) -> None:
    """Params that claim P runs TP 3 (3 does not fit 2 KV heads): D names the sizes, reads
    nothing, and tells P to free at once instead of letting the lease run out."""
    prompt = PROMPTS[97]
    params = complete(
        fleet.p1.url,
        prompt,
        model=SERVED_MODEL_NAME,
        max_tokens=1,
        extra={"kv_transfer_params": dict(PREFILL_LEG_PARAMS)},
    ).kv_transfer_params
    assert params and params["tp_size"] == 1
    params = dict(params, tp_size=3)
    pulls = pulled(fleet.d1)[0]
    invalid = hixl_counter(fleet.d1, "invalid_requests")
    handshakes = hixl_counter(fleet.d1, "failed_handshakes")
    failed = request_fails(fleet.d1.url, prompt, extra={"kv_transfer_params": params})
    assert failed, "D decoded although the TP sizes cannot be mapped"
    assert "prefill tp_size=3 exceeds num_kv_heads=2" in fleet.d1.log_tail(200)
    assert pulled(fleet.d1)[0] == pulls
    # Counted as what it is: a request D could not pull for, not a failed handshake.
    assert wait_for_counter(fleet.d1, "invalid_requests", invalid + 1) == invalid + 1
    assert hixl_counter(fleet.d1, "failed_handshakes") == handshakes
    wait_kv_idle(fleet.p1)  # well within the 30 s lease: D released it


def test_other_kv_head_counts_are_refused_naming_the_field(fleet: Fleet) -> None:
    """D's model has 4 KV heads, P's 2: the handshake names num_kv_heads, nothing is read,
    the request fails, and D tells P to free at once."""
    router = fleet.launcher.router("router_kv4", [fleet.p1], [fleet.d_kv4])
    handshakes = hixl_counter(fleet.d_kv4, "failed_handshakes")
    failed = request_fails(router.url, PROMPTS[97])
    assert failed, "D decoded KV of a model with another KV-head count"
    assert "num_kv_heads: local=4 remote=2" in fleet.d_kv4.log_tail(200)
    assert pulled(fleet.d_kv4)[0] == 0
    assert wait_for_counter(fleet.d_kv4, "failed_handshakes", handshakes + 1) == handshakes + 1
    wait_kv_idle(fleet.p1)
