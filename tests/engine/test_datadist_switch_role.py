"""Switch role and links both ways (HIXL's switch_role sample, in its call order), between
real processes over both transports.

This process starts as the decoder: it links to the prompt side (prompt_peer.py), pulls,
unlinks. Both switch roles; the former prompt side, now without a listener, links here; this
side pushes to it and pulls its cache back over the link back, and the bytes match a model of
what the peer must hold. Once the peer unlinks, the link back is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from . import datadist_peer as layout
from .datadist_harness import Client, start_prompt_side, wait_until
from .native_peer import NativePeer, stop_peer_process

NB, NT, BB = layout.NUM_BLOCKS, layout.NUM_TENSORS, layout.BLOCK_BYTES
EVERY_BLOCK = list(range(NB))


@pytest.fixture(params=["cma", "tcp"])
def sides(
    request: pytest.FixtureRequest, api: Any, client_factory: Any, datadist_backend: str
) -> Iterator[tuple[Client, NativePeer, str]]:
    if datadist_backend != "native":
        pytest.skip("the peer process runs the native engine")
    transport = request.param
    client = client_factory(hixl_transport=transport)
    prompt = start_prompt_side(41 if transport == "cma" else 42, transport)
    yield client, prompt, transport
    stop_peer_process(prompt.process)


def kv_model() -> list[np.ndarray]:
    return [t.reshape(NB, BB).copy() for t in layout.make_tensors("kv", NT, NB * BB)]


def test_switch_role_then_push_and_pull_over_the_link_back(
    sides: tuple[Client, NativePeer, str],
) -> None:
    client, prompt, transport = sides
    api, dd = client.api, client.dd
    ok = api.LLMStatusCode.LLM_SUCCESS
    cm = dd.cache_manager
    cache, tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    key = api.BlocksCacheKey(prompt.cluster_id, 0)
    model = kv_model()

    # 1. The decoder links to the listening prompt side, pulls, unlinks.
    assert client.link(prompt) == (ok, [ok])
    assert dd.peer_transport(prompt.cluster_id) == transport
    cm.pull_blocks(key, cache, [0, 1], [0, 2])
    for t in range(NT):
        got = tensors[t].reshape(NB, BB)
        assert np.array_equal(got[0], model[t][0]) and np.array_equal(got[2], model[t][1])
        assert not got[1].any(), "a block the pull did not name changed"
    assert client.unlink(prompt) == (ok, [ok])

    # 2. Both switch roles: the prompt side stops listening, this side listens.
    assert prompt.command("switch") == {"listen_port": -1}
    dd.switch_role(api.LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
    port = dd.listen_port
    assert port > 0

    # 3. The former prompt side links here; this side pushes to it over the link back.
    assert prompt.command(f"link {port} 1000") == {"status": "LLM_SUCCESS"}
    mine = [t.reshape(NB, BB) for t in tensors]
    cm.push_blocks(
        key,
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[5, 6, 7],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
    )
    for t in range(4):  # layers 0 and 1: K and V of each
        for src, dst in ((0, 5), (1, 6), (2, 7)):
            model[t][dst] = mine[t][src]
    assert dd.peer_transport(prompt.cluster_id) == transport

    # 4. ...and reads its whole cache back the same way: the pushed blocks and nothing else.
    back, back_tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    cm.pull_blocks(key, back, EVERY_BLOCK, EVERY_BLOCK)
    for t in range(NT):
        got = back_tensors[t].reshape(NB, BB)
        wrong = [b for b in range(NB) if not np.array_equal(got[b], model[t][b])]
        assert not wrong, f"tensor {t}: blocks {wrong} differ from the model"

    # 5. Once the linker unlinks, the link back is gone: nothing reaches it, nothing holds
    # this side's role.
    assert prompt.command("unlink 1000") == {"status": "LLM_SUCCESS"}
    wait_until(lambda: dd.engine_stats()["open_links"] == 0, 5, "the link back to close")
    with pytest.raises(api.LLMException) as refused:
        cm.push_blocks(key, cache, [0], [0])
    assert refused.value.status_code == api.LLMStatusCode.LLM_NOT_YET_LINK
    dd.switch_role(api.LLMRole.DECODER)
    assert dd.listen_port == -1
    cm.unregister_cache(back.cache_id)
    cm.unregister_cache(cache.cache_id)


def test_a_listener_pushes_back_to_a_linker_that_also_listens(
    sides: tuple[Client, NativePeer, str],
) -> None:
    """The linker offers its own listener: the link back goes there."""
    client, prompt, _ = sides
    api, dd = client.api, client.dd
    dd.switch_role(api.LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
    cache, tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    for t, tensor in enumerate(tensors):
        tensor[:] = layout.tensor_bytes(5, "mine", t, tensor.nbytes)
    assert prompt.command(f"link {dd.listen_port} 1000") == {"status": "LLM_SUCCESS"}
    key = api.BlocksCacheKey(prompt.cluster_id, 0)
    dd.cache_manager.push_blocks(key, cache, [3], [9])
    back, back_tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
    dd.cache_manager.pull_blocks(key, back, [9, 10], [0, 1])
    model = kv_model()
    for t in range(NT):
        got = back_tensors[t].reshape(NB, BB)
        assert np.array_equal(got[0], tensors[t].reshape(NB, BB)[3])
        assert np.array_equal(got[1], model[t][10])
    assert prompt.command("unlink 1000") == {"status": "LLM_SUCCESS"}
    wait_until(lambda: dd.engine_stats()["open_links"] == 0, 5, "the link back to close")
    dd.switch_role(api.LLMRole.DECODER)


def test_links_one_way_when_asked(api: Any, client_factory: Any, datadist_backend: str) -> None:
    """hixl_links_both_ways off (the connector's pull mode): the linked side cannot reach
    back, and nothing of the linker's listens."""
    if datadist_backend != "native":
        pytest.skip("the peer process runs the native engine")
    client = client_factory(hixl_links_both_ways=False)
    prompt = start_prompt_side(45, "auto")
    try:
        client.blocks_cache(NT, NB, layout.BLOCK_SHAPE, key=api.BlocksCacheKey(1000, 0))
        ok = api.LLMStatusCode.LLM_SUCCESS
        assert client.link(prompt) == (ok, [ok])
        assert prompt.command("push 1000 0 0") == {"status": "LLM_NOT_YET_LINK"}
        assert client.dd.listen_port == -1
        client.unlink(prompt)
    finally:
        stop_peer_process(prompt.process)
