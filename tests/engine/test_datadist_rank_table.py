"""Rank-table links (LLMDataDist.link / unlink / query_register_mem_status) between two real
processes, and switch_role's listener moves."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hixl_connector.datadist import LLMException, LLMStatusCode, RegisterMemStatus
from hixl_connector.datadist.native.parity import rank_table
from hixl_connector.tools.demo.processes import free_port_range

from . import datadist_peer as layout
from . import rank_table_peer as member
from .native_peer import stop_peer_process

NB, NT, BB = layout.NUM_BLOCKS, layout.NUM_TENSORS, layout.BLOCK_BYTES
ROW = layout.CONTIG_ROW_BYTES


def wait_ok(dd: Any, comm: int, timeout_s: float = 30) -> RegisterMemStatus:
    deadline = time.monotonic() + timeout_s
    while (status := dd.query_register_mem_status(comm)) == RegisterMemStatus.PREPARING:
        assert time.monotonic() < deadline, "the comm stayed PREPARING"
        time.sleep(0.02)
    return RegisterMemStatus(status)


@pytest.fixture()
def base_port(monkeypatch: pytest.MonkeyPatch) -> int:
    port = free_port_range(2)  # rank 0 and rank 1 listen on port and port + 1
    monkeypatch.setenv(rank_table.BASE_PORT_ENV, str(port))
    return port


def test_rank_table_link_pulls_what_the_peer_registered_before_and_after(
    client_factory: Any, base_port: int, datadist_backend: str
) -> None:
    if datadist_backend != "native":
        pytest.skip("CANN's link needs HCCL devices")
    env = dict(os.environ)
    peer = subprocess.Popen(
        [sys.executable, str(Path(member.__file__))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        client = client_factory(
            cluster_id=member.OTHER,
            enable_remote_cache_accessible=False,
            mem_pool_cfg=json.dumps({"memory_size": 1 << 20}),
        )
        cache, tensors = client.blocks_cache(NT, NB, layout.BLOCK_SHAPE)
        comm = client.dd.link("link", {member.CLUSTER: 0, member.OTHER: 1}, member.rank_table())
        assert wait_ok(client.dd, comm) == RegisterMemStatus.OK
        assert peer.stdout is not None
        ready, _, _ = select.select([peer.stdout], [], [], 30)
        assert ready and json.loads(peer.stdout.readline()) == {"status": "OK"}
        cm, api = client.dd.cache_manager, client.api
        cm.pull_blocks(api.BlocksCacheKey(member.CLUSTER, 0), cache, [3, 9], [0, 1])
        kv = layout.make_tensors("kv", NT, NB * BB)
        for t in range(NT):
            assert np.array_equal(tensors[t][:BB], kv[t][3 * BB : 4 * BB])
            assert np.array_equal(tensors[t][BB : 2 * BB], kv[t][9 * BB : 10 * BB])
        # Allocated by the peer after the link: found as in CANN, where the owner serves it.
        count = ROW // BB
        cm.pull_blocks(
            api.CacheKey(member.CLUSTER, member.KEY_REQ_ID), cache, [], list(range(count))
        )
        contig = layout.make_tensors("contig", NT, 2 * ROW)
        for t in range(NT):
            assert np.array_equal(tensors[t][: count * BB], contig[t][:ROW])
        with pytest.raises(LLMException) as info:
            client.blocks_cache(NT, NB, layout.BLOCK_SHAPE, accessible=True)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID  # after link()
        with pytest.raises(LLMException) as info:
            client.dd.switch_role(api.LLMRole.PROMPT)
        assert info.value.status_code == LLMStatusCode.LLM_EXIST_LINK
        client.dd.unlink(comm)
        with pytest.raises(LLMException) as info:
            client.dd.query_register_mem_status(comm)
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
    finally:
        stop_peer_process(peer)
    assert peer.returncode == 0


def test_rank_table_refusals_and_a_member_that_never_comes(
    client_factory: Any, base_port: int, monkeypatch: pytest.MonkeyPatch, datadist_backend: str
) -> None:
    if datadist_backend != "native":
        pytest.skip("CANN's link needs HCCL devices")
    client = client_factory(cluster_id=member.OTHER)
    dd, table = client.dd, member.rank_table()
    param = LLMStatusCode.LLM_PARAM_INVALID
    for args in (
        ("link", {member.CLUSTER: 0, member.OTHER: 1}, "{}"),  # no server_list
        ("link", {member.CLUSTER: 0, 9: 1}, table),  # this cluster is not a member
        ("link", {member.OTHER: 1, member.CLUSTER: 0}, table),  # ranks out of order
        ("link", {member.OTHER: 1}, table),  # one member
        ("", {member.CLUSTER: 0, member.OTHER: 1}, table),
    ):
        with pytest.raises(LLMException) as info:
            dd.link(*args)
        assert info.value.status_code == param, args
    with pytest.raises(TypeError):
        dd.link("link", {member.CLUSTER: "0", member.OTHER: 1}, table)
    monkeypatch.setattr(rank_table, "LINK_TIMEOUT_S", 0.5)
    comm = dd.link("link", {member.CLUSTER: 0, member.OTHER: 1}, table)
    assert wait_ok(dd, comm, timeout_s=10) == RegisterMemStatus.FAILED
    dd.unlink(comm)
    # switch_role moves the listener: there without listen options, a new one with them.
    assert dd.listen_port == base_port + 1  # rank 1's, from link()
    dd.switch_role(client.api.LLMRole.DECODER)
    assert dd.listen_port == -1
    dd.switch_role(client.api.LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
    assert dd.listen_port > 0
