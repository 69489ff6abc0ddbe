"""Write grants through the datadist API (an extension of the native engine), in the shape
push mode has: this process, the decode side, registers its KV with
``hixl_writes_by_grant`` and links to the prompt side (prompt_peer.py), which pushes into it
over the link back. A push lands only in blocks of the grant it names
(``hixl_write_grant``), granted to the prompt side's cluster, and after ``revoke_writes``
nothing lands there, not even when the same blocks went to the same prompt side again under
a new grant."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from . import datadist_peer as layout
from .datadist_harness import Client, start_prompt_side, wait_blocked
from .native_peer import NativePeer, stop_peer_process

NB, NT, BB = layout.NUM_BLOCKS, layout.NUM_TENSORS, layout.BLOCK_BYTES
DECODE = 1000


@pytest.fixture(params=["cma", "tcp"])
def sides(
    request: pytest.FixtureRequest, client_factory: Any, datadist_backend: str
) -> Iterator[tuple[Client, NativePeer]]:
    if datadist_backend != "native":
        pytest.skip("write grants are the native engine's")
    client = client_factory(
        cluster_id=DECODE, hixl_transport=request.param, hixl_writes_by_grant=True
    )
    prompt = start_prompt_side(43 if request.param == "cma" else 44, request.param)
    ok = client.api.LLMStatusCode.LLM_SUCCESS
    assert client.link(prompt) == (ok, [ok])
    yield client, prompt
    client.unlink(prompt)
    stop_peer_process(prompt.process)


def push(prompt: NativePeer, src: list[int], dst: list[int], grant: int) -> str:
    blocks = f"{','.join(map(str, src))} {','.join(map(str, dst))}"
    return str(prompt.command(f"push {DECODE} {blocks} {grant}")["status"])


def assert_model(tensors: list[np.ndarray], model: list[np.ndarray]) -> None:
    for t in range(NT):
        got = tensors[t].reshape(NB, BB)
        wrong = [b for b in range(NB) if not np.array_equal(got[b], model[t][b])]
        assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"


def test_pushes_land_only_while_and_where_granted(sides: tuple[Client, NativePeer]) -> None:
    client, prompt = sides
    api, cm = client.api, client.dd.cache_manager
    cache, tensors = client.blocks_cache(
        NT, NB, layout.BLOCK_SHAPE, key=api.BlocksCacheKey(DECODE, 0)
    )
    kv = [t.reshape(NB, BB) for t in layout.make_tensors("kv", NT, NB * BB)]
    model = [np.zeros((NB, BB), np.uint8) for _ in range(NT)]
    assert push(prompt, [0], [3], 0) == "LLM_PARAM_INVALID"  # nothing granted yet
    grant = cm.grant_writes(cache, prompt.cluster_id, [3, 4])
    assert 0 < grant < 2**63
    assert push(prompt, [0], [3], 0) == "LLM_PARAM_INVALID"  # granted, but named no grant
    assert push(prompt, [0, 1], [3, 4], grant) == "LLM_SUCCESS"
    for t in range(NT):
        model[t][3], model[t][4] = kv[t][0], kv[t][1]
    assert push(prompt, [5, 6, 7], [3, 4, 5], grant) == "LLM_PARAM_INVALID"  # reaches past it
    with pytest.raises(api.LLMException) as taken:
        cm.grant_writes(cache, 77, [4, 9])
    assert taken.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(api.LLMException) as outside:
        cm.grant_writes(cache, 77, [NB])
    assert outside.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    cm.revoke_writes(grant)
    assert push(prompt, [2], [3], grant) == "LLM_PARAM_INVALID"
    cm.revoke_writes(grant)  # a revoked grant: nothing to wait for
    with pytest.raises(api.LLMException) as unknown:
        cm.revoke_writes(grant + 100)
    assert unknown.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    assert_model(tensors, model)
    # The same blocks to the same prompt side, for another request: a late push naming the
    # revoked grant still misses them, one naming the new grant lands.
    again = cm.grant_writes(cache, prompt.cluster_id, [3, 4])
    assert again != grant
    assert push(prompt, [6, 7], [3, 4], grant) == "LLM_PARAM_INVALID"
    assert_model(tensors, model)
    assert push(prompt, [6, 7], [3, 4], again) == "LLM_SUCCESS"
    for t in range(NT):
        model[t][3], model[t][4] = kv[t][6], kv[t][7]
    assert_model(tensors, model)
    cm.revoke_writes(again)
    cm.unregister_cache(cache.cache_id)


def test_pushes_at_once_over_a_link_back_not_open_yet_all_land(
    sides: tuple[Client, NativePeer],
) -> None:
    """The prompt side's first pushes to a decode side that linked to it open the link back
    once; pushes that need it meanwhile wait for that opening instead of failing."""
    client, prompt = sides
    api, cm = client.api, client.dd.cache_manager
    cache, tensors = client.blocks_cache(
        NT, NB, layout.BLOCK_SHAPE, key=api.BlocksCacheKey(DECODE, 0)
    )
    kv = [t.reshape(NB, BB) for t in layout.make_tensors("kv", NT, NB * BB)]
    grant = cm.grant_writes(cache, prompt.cluster_id, [3, 4])
    answer = prompt.command(f"pushes 8 {DECODE} 0,1 3,4 {grant}")
    assert answer["status"] == ["LLM_SUCCESS"] * 8
    model = [np.zeros((NB, BB), np.uint8) for _ in range(NT)]
    for t in range(NT):
        model[t][3], model[t][4] = kv[t][0], kv[t][1]
    assert_model(tensors, model)
    cm.revoke_writes(grant)
    cm.unregister_cache(cache.cache_id)


def test_a_waiter_sleeps_until_a_push_lands(sides: tuple[Client, NativePeer]) -> None:
    """``wait_for_writes`` returns when the prompt side's push lands (not at its timeout), and
    at its timeout when nothing lands; a refused push lands nothing and counts nothing."""
    client, prompt = sides
    api, cm = client.api, client.dd.cache_manager
    cache, _ = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE, key=api.BlocksCacheKey(DECODE, 0))
    grant = cm.grant_writes(cache, prompt.cluster_id, [3, 4])
    seen = cm.writes_landed()
    start = time.monotonic()
    assert cm.wait_for_writes(seen, 200) == seen
    assert time.monotonic() - start >= 0.19
    assert push(prompt, [0], [5], grant) == "LLM_PARAM_INVALID"
    assert cm.writes_landed() == seen
    woke: list[tuple[int, float]] = []

    def wait() -> None:
        woke.append((cm.wait_for_writes(seen, 10_000), time.monotonic()))

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_blocked(waiter)  # asleep in wait_for_writes (or woke already)
    assert not woke
    pushing = time.monotonic()
    assert push(prompt, [0, 1], [3, 4], grant) == "LLM_SUCCESS"
    answered = time.monotonic()
    waiter.join(timeout=10)
    assert woke and woke[0][0] == seen + 1
    assert woke[0][1] >= pushing, "the waiter woke before the push"
    assert woke[0][1] - answered < 1.0, "the waiter slept on after the push landed"
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            cm.wait_for_writes(bad, 1)
    cm.revoke_writes(grant)
    cm.unregister_cache(cache.cache_id)


def test_hixl_write_grant_is_checked(client_factory: Any, datadist_backend: str) -> None:
    """push_blocks' extension kwarg: an int in [0, 2**63), checked before anything moves."""
    if datadist_backend != "native":
        pytest.skip("write grants are the native engine's")
    client = client_factory(cluster_id=DECODE)
    api, cm = client.api, client.dd.cache_manager
    src, _ = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    key = api.BlocksCacheKey(DECODE + 1, 0)  # never linked: a valid grant gets that far
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="hixl_write_grant only support"):
            cm.push_blocks(key, src, [0], [0], hixl_write_grant=bad)
    for bad in (-1, 2**63, 2**64):
        with pytest.raises(api.LLMException) as out_of_range:
            cm.push_blocks(key, src, [0], [0], hixl_write_grant=bad)
        assert out_of_range.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
        assert "hixl_write_grant" in str(out_of_range.value)
    with pytest.raises(TypeError, match="unexpected keyword"):
        cm.push_blocks(key, src, [0], [0], hixl_write_grants=1)
    for fine in (0, 1, 2**63 - 1):
        with pytest.raises(api.LLMException) as unlinked:
            cm.push_blocks(key, src, [0], [0], hixl_write_grant=fine)
        assert unlinked.value.status_code == api.LLMStatusCode.LLM_NOT_YET_LINK
