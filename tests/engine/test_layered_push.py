"""P's request push (``request_push``) between two real engines in this process: P writes
the layers of a prompt into D's granted blocks one by one, then what is left and its lease
word last; a failed layer means no word, and the lease ends either way."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RankAddress
from hixl_connector.connector.kv.layout import describe_kv_caches
from hixl_connector.connector.kv.registered_kv import RegisteredKV, register_kv
from hixl_connector.connector.leases.server import LeaseTable
from hixl_connector.connector.mapping.tp_mapping import unit_ids
from hixl_connector.connector.metadata import PromptBlocks, SendSpec
from hixl_connector.connector.push.registration import PushRegistration
from hixl_connector.connector.push.request_push import RequestPush
from hixl_connector.connector.push.sender import PushSender
from hixl_connector.connector.push.status import GaveUp, PushStatusQuery, gave_up_in

LAYERS, BLOCKS, HEADS = 4, 8, 2
P_CLUSTER, D_CLUSTER = 7100, 7200
SRC, DST = (1, 2, 3), (5, 6, 7)
WORD_SLOT, LEASE_WORD, LEASE_ID = 3, 0x5EED_0000_0001, 77


def _engine(kv: torch.Tensor, cluster_id: int, producer: bool) -> RegisteredKV:
    config = HixlConfig.from_dict(
        {"backend": "native", "transfer_mode": "push", "auth_token": ""}, f"c{cluster_id}"
    )
    layout = describe_kv_caches(
        {f"model.layers.{i}.attn": kv[i] for i in range(LAYERS)}, BLOCKS, HEADS
    )
    return register_kv(config, layout, RankAddress(cluster_id, 0, 0), producer, not producer)


def _decode_side(kv: torch.Tensor, p_port: int, conn: Connection) -> None:
    """D, in a process of its own (one engine per process): links P, then grants, revokes
    and reads its push word on command. Its KV is shared memory the test reads."""
    d = _engine(kv, D_CLUSTER, False)
    api: Any = d.api
    info = api.LLMClusterInfo()
    info.remote_cluster_id = P_CLUSTER
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", p_port)
    ok = api.LLMStatusCode.LLM_SUCCESS
    conn.send(d.datadist.link_clusters([info], 5000) == (ok, [ok]))
    while (command := conn.recv()) != "stop":
        if command == "grant":
            grants = tuple(
                d.grant(
                    P_CLUSTER, part, unit_ids(DST, part.units_per_block, 0, part.units_per_block)
                )
                for part in d.caches
            )
            assert d.push_words is not None
            conn.send((grants, d.grant(P_CLUSTER, d.push_words, [0])))
        elif command == "word":
            assert d.push_word_memory is not None
            conn.send(d.push_word_memory.read(0, 1)[0])
        elif command == "clear":
            assert d.push_word_memory is not None
            d.push_word_memory.zero(0, 1)
            conn.send(None)
        else:
            d.revoke(int(command), 5.0)
            conn.send(None)
    d.datadist.finalize()


@dataclass
class Pair:
    p_kv: torch.Tensor
    d_kv: torch.Tensor
    p: RegisteredKV
    conn: Connection
    counts: dict[str, int]
    pool: ThreadPoolExecutor
    grants: list[int]  # D's, not revoked yet
    gave_up: list[tuple[str, GaveUp]]  # what P told its D it will not push, and why

    def registration(self) -> PushRegistration:
        self.conn.send("grant")
        grants, word_grant = self.conn.recv()
        self.grants += [*grants, word_grant]
        return PushRegistration("req", D_CLUSTER, (0, 1, 2), DST, grants, (0, word_grant), 30.0)

    def revoke(self, grant: int) -> None:
        self.conn.send(str(grant))
        self.conn.recv()
        self.grants.remove(grant)

    def push(self, registration: PushRegistration) -> RequestPush:
        def record(name: str, n: int) -> None:
            self.counts[name] = self.counts.get(name, 0) + n

        def gave_up(registration: PushRegistration, why: GaveUp) -> None:
            self.gave_up.append((registration.request, why))

        return RequestPush(self.p, registration, SRC, LAYERS, self.pool, record, gave_up)

    def layer_landed(self, layer: int) -> bool:
        return torch.equal(self.d_kv[layer][list(DST)], self.p_kv[layer][list(SRC)])

    def word(self) -> int:
        self.conn.send("word")
        return int(self.conn.recv())


@pytest.fixture(scope="module")
def engines() -> Iterator[Pair]:
    p_kv = torch.randn(LAYERS, BLOCKS, HEADS, 16, 64)
    d_kv = torch.zeros_like(p_kv).share_memory_()
    p = _engine(p_kv, P_CLUSTER, True)
    assert p.lease_word_memory is not None
    p.lease_word_memory.write(WORD_SLOT, LEASE_WORD)
    pool = ThreadPoolExecutor(2)
    context = torch.multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_decode_side, args=(d_kv, p.listen_port, child_conn))
    child.start()
    child_conn.close()  # a D that died reads as EOF here
    try:
        assert conn.poll(60) and conn.recv(), "D did not link P"
        yield Pair(p_kv, d_kv, p, conn, {}, pool, [], [])
        conn.send("stop")
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        pool.shutdown(wait=True)
        p.datadist.finalize()


@pytest.fixture
def pair(engines: Pair) -> Iterator[Pair]:
    """The engines, with D's blocks and word cleared and nothing counted; D revokes what
    it granted afterwards (a block is under one grant at a time)."""
    engines.d_kv.zero_()
    engines.conn.send("clear")
    engines.conn.recv()
    engines.counts.clear()
    engines.gave_up.clear()
    yield engines
    for grant in list(engines.grants):
        engines.revoke(grant)


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _finish(pair: Pair, push: RequestPush) -> LeaseTable:
    leases = LeaseTable(lease_s=30.0)
    leases.start("req-0", LEASE_ID, time.monotonic(), WORD_SLOT, LEASE_WORD)
    push.finish(
        SendSpec("req-0", LEASE_ID, WORD_SLOT, LEASE_WORD, ((1, 2, 3, 4),)), leases, lambda: None
    )
    _until(lambda: len(leases) == 0)  # the push ended the lease
    return leases


def test_layers_land_one_by_one_then_the_rest_and_the_word(pair: Pair) -> None:
    push = pair.push(pair.registration())
    push.write_layers(range(0, 1))
    push.write_layers(range(2, 3))
    _until(lambda: pair.layer_landed(0) and pair.layer_landed(2))
    assert not pair.layer_landed(1) and not pair.layer_landed(3)  # only what was computed
    assert pair.word() == 0
    _finish(pair, push)
    assert all(pair.layer_landed(layer) for layer in range(LAYERS))
    assert pair.word() == LEASE_WORD
    assert pair.counts == {"pushes": 1, "layered_pushes": 1}
    untouched = [b for b in range(BLOCKS) if b not in DST]
    assert not pair.d_kv[:, untouched].any()  # nothing outside the grant


def test_a_whole_push_is_not_counted_as_layered(pair: Pair) -> None:
    push = pair.push(pair.registration())
    _finish(pair, push)
    assert all(pair.layer_landed(layer) for layer in range(LAYERS))
    assert pair.word() == LEASE_WORD
    assert pair.counts == {"pushes": 1}


def test_a_refused_layer_means_no_word(pair: Pair) -> None:
    registration = pair.registration()
    push = pair.push(registration)
    pair.revoke(registration.grants[0])  # D gave up: nothing may land any more
    push.write_layers(range(0, 2))
    _finish(pair, push)
    assert pair.word() == 0
    assert not pair.d_kv.any()
    assert pair.counts == {"failed_pushes": 1}
    # D hears of it when it next asks; a refused grant is no lost link.
    ((request, why),) = pair.gave_up
    assert request == "req" and "P's push failed" in why.reason and not why.relink


def _sender(pair: Pair, leases: LeaseTable | None = None) -> PushSender:
    def record(name: str, n: int) -> None:
        pair.counts[name] = pair.counts.get(name, 0) + n

    layers = {f"model.layers.{i}.attn": i for i in range(LAYERS)}
    table = LeaseTable(lease_s=30.0) if leases is None else leases
    return PushSender(pair.p, table, layers, 2, record, lambda: None)


def _gave_up(sender: PushSender, request: str) -> dict[str, GaveUp]:
    return gave_up_in(
        sender._on_status(PushStatusQuery(D_CLUSTER, (request,)).to_dict()), [request]
    )


def test_a_prompt_ended_without_a_lease_tells_its_d_and_refuses_a_late_one(pair: Pair) -> None:
    """P's prefill was aborted (its scheduler names it in ``not_pushed``) after D registered
    and P began writing its layers: the layers not yet written are not, no word comes, P's
    answer to D's next status question says why, and a D registering later is refused."""
    sender = _sender(pair)
    try:
        registration = pair.registration()
        sender._on_register(registration.to_dict())
        assert _gave_up(sender, "req") == {}
        sender.computing([PromptBlocks("req-0badcafe", (SRC,))])
        sender.layer_saved("model.layers.0.attn")
        _until(lambda: pair.layer_landed(0))
        sender.not_pushed(["req-0badcafe"])
        sender.layer_saved("model.layers.1.attn")  # the forward goes on: nothing written
        sender.computed()
        ((request, why),) = _gave_up(sender, "req").items()
        assert request == "req" and "ended without KV" in why.reason and not why.relink
        time.sleep(0.2)
        assert not pair.layer_landed(1) and pair.word() == 0
        with pytest.raises(ValueError, match="nothing will be pushed"):
            sender._on_register(registration.to_dict())  # its D, once more
    finally:
        sender.close()


@pytest.mark.parametrize("finished_first", [True, False], ids=["get_finished", "wait_for_save"])
def test_a_push_is_reported_once_whichever_end_of_step_hook_comes_first(
    pair: Pair, finished_first: bool
) -> None:
    """vLLM 0.33's Model Runner V2 with a speculator asks a step's finished transfers
    (``get_finished``) before ``wait_for_save``, older runners after it. P's writes follow the
    layers as they are computed, and a request is reported finished when its lease ends (its
    word landed on D), not by ``wait_for_save``: in either order the KV lands whole and the
    request is reported once."""
    leases = LeaseTable(lease_s=30.0)
    sender = _sender(pair, leases)
    reported: list[str] = []

    def end_of_step() -> None:
        def get_finished() -> None:
            reported.extend(lease.request_id for lease in leases.take_finished())

        hooks = [get_finished, sender.computed]
        for hook in hooks if finished_first else reversed(hooks):
            hook()

    try:
        sender._on_register(pair.registration().to_dict())
        sender.computing([PromptBlocks("req-0badcafe", (SRC,))])  # the prefill's forward
        for layer in range(LAYERS):
            sender.layer_saved(f"model.layers.{layer}.attn")
        end_of_step()
        assert reported == []
        # The next step: the scheduler finished the prefill, P leases its blocks.
        leases.start("req-0badcafe", LEASE_ID, time.monotonic(), WORD_SLOT, LEASE_WORD)
        sender.hold([SendSpec("req-0badcafe", LEASE_ID, WORD_SLOT, LEASE_WORD, (SRC,))])

        def next_step_reported() -> bool:
            sender.computing([])
            end_of_step()
            return bool(reported)

        _until(next_step_reported)
        for _ in range(3):  # later steps report nothing more
            next_step_reported()
        assert reported == ["req-0badcafe"]
        assert all(pair.layer_landed(layer) for layer in range(LAYERS))
        assert pair.word() == LEASE_WORD
        assert pair.counts == {"early_push_registrations": 1, "pushes": 1, "layered_pushes": 1}
    finally:
        sender.close()
