"""Write grants through the datadist API (an extension of the native engine), in the shape
push mode has: this process, the decode side, registers its KV with
``hixl_writes_by_grant`` and links to the prompt side (prompt_peer.py), which pushes into it
over the link back. A push lands only in blocks granted to the prompt side's cluster, and
after ``revoke_writes`` nothing lands there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from . import datadist_peer as layout
from .datadist_harness import Client, start_prompt_side
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


def push(prompt: NativePeer, src: list[int], dst: list[int]) -> str:
    answer = prompt.command(f"push {DECODE} {','.join(map(str, src))} {','.join(map(str, dst))}")
    return str(answer["status"])


def test_pushes_land_only_while_and_where_granted(sides: tuple[Client, NativePeer]) -> None:
    client, prompt = sides
    api, cm = client.api, client.dd.cache_manager
    cache, tensors = client.blocks_cache(
        NT, NB, layout.BLOCK_SHAPE, key=api.BlocksCacheKey(DECODE, 0)
    )
    kv = [t.reshape(NB, BB) for t in layout.make_tensors("kv", NT, NB * BB)]
    model = [np.zeros((NB, BB), np.uint8) for _ in range(NT)]
    assert push(prompt, [0], [3]) == "LLM_PARAM_INVALID"  # nothing granted yet
    grant = cm.grant_writes(cache, prompt.cluster_id, [3, 4])
    assert push(prompt, [0, 1], [3, 4]) == "LLM_SUCCESS"
    for t in range(NT):
        model[t][3], model[t][4] = kv[t][0], kv[t][1]
    assert push(prompt, [5, 6, 7], [3, 4, 5]) == "LLM_PARAM_INVALID"  # reaches past it
    with pytest.raises(api.LLMException) as taken:
        cm.grant_writes(cache, 77, [4, 9])
    assert taken.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(api.LLMException) as outside:
        cm.grant_writes(cache, 77, [NB])
    assert outside.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    cm.revoke_writes(grant)
    assert push(prompt, [2], [3]) == "LLM_PARAM_INVALID"
    cm.revoke_writes(grant)  # a revoked grant: nothing to wait for
    with pytest.raises(api.LLMException) as unknown:
        cm.revoke_writes(grant + 100)
    assert unknown.value.status_code == api.LLMStatusCode.LLM_PARAM_INVALID
    for t in range(NT):
        got = tensors[t].reshape(NB, BB)
        wrong = [b for b in range(NB) if not np.array_equal(got[b], model[t][b])]
        assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"
    cm.unregister_cache(cache.cache_id)
