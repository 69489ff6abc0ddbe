"""Native engine transfers against a real peer process, over cma and tcp, checked byte for byte."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl_connector import _native

from .native_peer import (
    BLOCKS_CACHE_ID,
    CONTIGUOUS_CACHE_ID,
    CONTIGUOUS_KEYS,
    MODEL_ID,
    NativePeer,
    pattern,
    start_peer,
)

PEER_CLUSTER = 11
TENSORS = 4
BLOCKS = 64
BLOCK_BYTES = 4096
ROW_BYTES = 65536
DST_CACHE = 50
SENTINEL = 0xEE
TIMEOUT_MS = 3000
MAX_OUTSTANDING_PULLS = 4096  # native/src/engine.cpp


class Puller:
    """A client engine in this process with one blocks cache as pull destination."""

    def __init__(
        self, cluster_id: int, transport: str, block_bytes: int = BLOCK_BYTES, **options: Any
    ) -> None:
        self.engine = _native.Engine(cluster_id, transport=transport, **options)
        self.tensors = [np.full(BLOCKS * block_bytes, SENTINEL, np.uint8) for _ in range(TENSORS)]
        status, msg = self.engine.register_cache(
            DST_CACHE,
            [t.ctypes.data for t in self.tensors],
            BLOCKS * block_bytes,
            BLOCKS,
            True,
            True,
            -1,
            [],
        )
        assert status == _native.SUCCESS, msg

    def reset(self) -> None:
        for t in self.tensors:
            t.fill(SENTINEL)

    def pull_blocks(self, src: Any, dst: Any, cluster: int = PEER_CLUSTER, **kw: Any) -> Any:
        args = dict(
            remote_cluster_id=cluster,
            remote_kind=0,
            model_id=MODEL_ID,
            cache_id=-1,
            req_id=-1,
            prefix_id=-1,
            batch_index=0,
            dst_cache_id=DST_CACHE,
            src_blocks=src,
            dst_blocks=dst,
            src_tensor_first=0,
            src_tensor_count=-1,
            dst_tensor_first=0,
            dst_tensor_count=-1,
            timeout_ms=TIMEOUT_MS,
        )
        args.update(kw)
        if args.pop("submit", False):  # as a batch of one: the engine's asynchronous call
            return self.engine.submit_pull_batch([tuple(args.values())])
        return self.engine.pull(**args)


def pull_ok(puller: Puller, cluster: int, src: list[int], dst: list[int]) -> None:
    """Pulls src -> dst from `cluster`'s blocks cache; each dst block holds its src block."""
    puller.reset()
    assert puller.pull_blocks(src, dst, cluster=cluster) == (0, "")
    for t, data in enumerate(puller.tensors):
        expected = pattern(cluster, BLOCKS_CACHE_ID, t, (max(src) + 1) * BLOCK_BYTES)
        for s, d in zip(src, dst, strict=True):
            got = data[d * BLOCK_BYTES : (d + 1) * BLOCK_BYTES]
            assert np.array_equal(got, expected[s * BLOCK_BYTES : (s + 1) * BLOCK_BYTES])


def block(data: np.ndarray, index: int) -> np.ndarray:
    return data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES]


def check_blocks(
    puller: Puller, src: list[int], dst: list[int], tensor_map: dict[int, int] | None = None
) -> None:
    """dst blocks hold the peer's src blocks; every other byte still holds the sentinel."""
    tensor_map = tensor_map if tensor_map is not None else {t: t for t in range(TENSORS)}
    for dst_t, data in enumerate(puller.tensors):
        pulled = dict(zip(dst, src, strict=True)) if dst_t in tensor_map else {}
        expected_src = pattern(
            PEER_CLUSTER, BLOCKS_CACHE_ID, tensor_map.get(dst_t, 0), BLOCKS * BLOCK_BYTES
        )
        for b in range(BLOCKS):
            got = block(data, b)
            if b in pulled:
                assert np.array_equal(got, block(expected_src, pulled[b])), (dst_t, b)
            else:
                assert (got == SENTINEL).all(), f"tensor {dst_t} block {b} was written"


@pytest.fixture(scope="module")
def peer() -> Iterator[NativePeer]:
    p = start_peer(
        PEER_CLUSTER, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES, row_bytes=ROW_BYTES
    )
    yield p
    p.stop()


@pytest.fixture(scope="module", params=["cma", "tcp"])
def puller(request: pytest.FixtureRequest, peer: NativePeer) -> Iterator[Puller]:
    p = Puller(100, request.param)
    assert p.engine.link(PEER_CLUSTER, "127.0.0.1", peer.port, TIMEOUT_MS) == (0, "")
    assert p.engine.peer_transport(PEER_CLUSTER) == request.param
    yield p
    p.engine.close()


pairs = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True),
        st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True),
    )
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pairs)
def test_random_block_pairs_are_copied_exactly(
    puller: Puller, pair: tuple[list[int], list[int]]
) -> None:
    src, dst = pair
    puller.reset()
    as_array = len(src) % 2 == 0  # exercise both the list and the numpy input path
    status, msg = puller.pull_blocks(np.array(src, np.int64) if as_array else src, dst)
    assert status == _native.SUCCESS, msg
    check_blocks(puller, src, dst)


def test_large_multi_share_pull(puller: Puller) -> None:
    src = list(range(BLOCKS))
    dst = list(range(BLOCKS))[::-1]
    puller.reset()
    assert puller.pull_blocks(src, dst) == (0, "")
    check_blocks(puller, src, dst)


def test_tensor_ranges(puller: Puller) -> None:
    puller.reset()
    status, msg = puller.pull_blocks(
        [5, 6, 9],
        [1, 2, 3],
        src_tensor_first=1,
        src_tensor_count=2,
        dst_tensor_first=2,
        dst_tensor_count=2,
    )
    assert status == _native.SUCCESS, msg
    check_blocks(puller, [5, 6, 9], [1, 2, 3], tensor_map={2: 1, 3: 2})


def pull_contiguous(puller: Puller, dst: list[int], **key: int) -> Any:
    return puller.pull_blocks([], dst, cache_id=CONTIGUOUS_CACHE_ID, **key)


def check_row_slices(puller: Puller, row: int, dst: list[int]) -> None:
    """dst[i] holds slice i of the peer's contiguous batch row `row`, in every tensor."""
    for t, data in enumerate(puller.tensors):
        rows = pattern(PEER_CLUSTER, CONTIGUOUS_CACHE_ID, t, 2 * ROW_BYTES)
        for i, b in enumerate(dst):
            assert np.array_equal(block(data, b), block(rows[row * ROW_BYTES :], i)), (t, b)


def test_contiguous_row_slices_by_id_and_index(puller: Puller) -> None:
    puller.reset()
    slices = ROW_BYTES // BLOCK_BYTES
    dst = [40 + i for i in range(slices // 2)] + [3 + i for i in range(slices - slices // 2)]
    status, msg = pull_contiguous(puller, dst, remote_kind=1, batch_index=1)
    assert status == _native.SUCCESS, msg
    check_row_slices(puller, 1, dst)
    status, msg = pull_contiguous(puller, list(range(slices + 1)), remote_kind=1, batch_index=1)
    assert status == _native.PARAM_INVALID and "row" in msg
    status, msg = pull_contiguous(puller, [0], remote_kind=1, batch_index=2)
    assert status == _native.PARAM_INVALID and "batch_index 2" in msg


@pytest.mark.parametrize("row", [0, 1])
def test_cache_key_reads_the_row_of_its_key(puller: Puller, row: int) -> None:
    """A contiguous cache registered under keys k0, k1 holds key i in batch row i."""
    puller.reset()
    dst = [9, 2, 33]
    req, prefix, model = CONTIGUOUS_KEYS[row]
    status, msg = pull_contiguous(
        puller, dst, remote_kind=2, req_id=req, prefix_id=prefix, model_id=model
    )
    assert status == _native.SUCCESS, msg
    check_row_slices(puller, row, dst)
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert all((block(t, b) == SENTINEL).all() for t in puller.tensors for b in untouched)


def test_cache_key_errors(puller: Puller) -> None:
    req, prefix, model = CONTIGUOUS_KEYS[1]
    key = dict(remote_kind=2, req_id=req, prefix_id=prefix, model_id=model)
    status, msg = pull_contiguous(puller, [0], batch_index=1, **key)
    assert status == _native.PARAM_INVALID and "must be 0 for a CacheKey" in msg
    status, msg = pull_contiguous(puller, list(range(ROW_BYTES // BLOCK_BYTES + 1)), **key)
    assert status == _native.PARAM_INVALID and "row" in msg
    status, msg = pull_contiguous(puller, [0], **{**key, "req_id": 99})
    assert status == _native.KV_CACHE_NOT_EXIST and "req_id=99" in msg


def test_async_submit_wait_poll(puller: Puller) -> None:
    puller.reset()
    status, handle, _ = puller.pull_blocks([1, 2, 30], [7, 8, 9], submit=True)
    assert status == _native.SUCCESS
    assert puller.engine.wait(handle, TIMEOUT_MS) == (0, "")
    assert puller.engine.poll(handle) == (_native.PARAM_INVALID, "unknown handle")
    check_blocks(puller, [1, 2, 30], [7, 8, 9])
    status, handle, _ = puller.pull_blocks([1], [999], submit=True)
    assert status == _native.SUCCESS
    result = puller.engine.wait(handle, TIMEOUT_MS)
    assert result[0] == _native.PARAM_INVALID and "999" in result[1]
    assert puller.engine.wait(handle, 0)[0] == _native.PARAM_INVALID
    # More async pulls than pool threads, each big enough to want helper shares.
    puller.reset()
    src, dst = list(range(BLOCKS)), list(range(BLOCKS))[::-1]
    handles = [puller.pull_blocks(src, dst, submit=True)[1] for _ in range(6)]
    for h in handles:
        assert puller.engine.wait(h, -1) == (0, "")
    check_blocks(puller, src, dst)


def test_small_same_host_batches_are_copied_on_the_callers_thread(puller: Puller) -> None:
    """A cma batch under 1 MiB has landed when submit returns (a pool thread would first have
    to wake and get a core); a larger one, and any tcp batch, goes to the pool."""
    transport = puller.engine.peer_transport(PEER_CLUSTER)

    def submitted(src: list[int], dst: list[int]) -> tuple[int, int]:
        """(batches copied on the caller's thread, and the handle)."""
        before = puller.engine.stats()["caller_batches"]
        status, handle, message = puller.pull_blocks(src, dst, submit=True)
        assert status == _native.SUCCESS, message
        return puller.engine.stats()["caller_batches"] - before, handle

    puller.reset()
    here, handle = submitted([1, 2, 30], [7, 8, 9])  # 3 blocks x 4 tensors: 48 KiB
    if transport == "cma":
        assert here == 1
        assert puller.engine.poll(handle) == (0, "")  # landed before submit returned
    else:
        assert here == 0
        assert puller.engine.wait(handle, TIMEOUT_MS) == (0, "")
    check_blocks(puller, [1, 2, 30], [7, 8, 9])
    puller.reset()
    every = list(range(BLOCKS))
    here, handle = submitted(every, every[::-1])  # 64 blocks x 4 tensors: 1 MiB
    assert here == 0
    assert puller.engine.wait(handle, TIMEOUT_MS) == (0, "")
    check_blocks(puller, every, every[::-1])
    here, handle = submitted([1], [999])  # a bad block fails from the handle either way
    assert here == (1 if transport == "cma" else 0)
    result = puller.engine.wait(handle, TIMEOUT_MS)
    assert result[0] == _native.PARAM_INVALID and "999" in result[1]


def test_outstanding_async_pulls_are_capped(puller: Puller) -> None:
    """Handles hold their requests until waited for: a caller that never waits is refused."""
    handles = []
    while True:
        status, handle, message = puller.pull_blocks([1], [2], submit=True)
        if status != _native.SUCCESS:
            break
        handles.append(handle)
        assert len(handles) <= MAX_OUTSTANDING_PULLS
    assert status == _native.FAILED and str(MAX_OUTSTANDING_PULLS) in message
    assert len(handles) == MAX_OUTSTANDING_PULLS
    assert puller.engine.wait(handles.pop(), -1) == (0, "")
    status, handle, _ = puller.pull_blocks([1], [2], submit=True)  # one slot is free again
    assert status == _native.SUCCESS
    for h in [*handles, handle]:
        assert puller.engine.wait(h, -1) == (0, "")


def test_concurrent_pulls_from_four_threads(puller: Puller) -> None:
    puller.reset()
    rng = np.random.default_rng(7)
    dst_all = rng.permutation(BLOCKS)
    jobs = [
        (rng.permutation(BLOCKS)[:16].tolist(), dst_all[i * 16 : (i + 1) * 16].tolist())
        for i in range(4)
    ]
    errors: list[Any] = []

    def run(src: list[int], dst: list[int]) -> None:
        for _ in range(5):
            result = puller.pull_blocks(src, dst)
            if result != (0, ""):
                errors.append(result)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    check_blocks(puller, [s for j in jobs for s in j[0]], [d for j in jobs for d in j[1]])


def test_error_statuses_in_contract_order(puller: Puller, peer: NativePeer) -> None:
    pb = puller.pull_blocks
    code = lambda result: result[0]  # noqa: E731
    assert code(pb([1], [1], dst_cache_id=77, remote_cluster_id=999)) == _native.KV_CACHE_NOT_EXIST
    assert code(pb([1], [BLOCKS], remote_cluster_id=999)) == _native.PARAM_INVALID
    assert code(pb([1, 2], [1])) == _native.PARAM_INVALID
    assert code(pb([-1], [1])) == _native.PARAM_INVALID
    assert code(pb([1], [])) == _native.PARAM_INVALID
    assert code(pb([1], [1], dst_tensor_first=TENSORS)) == _native.PARAM_INVALID
    assert code(pb([1], [1], dst_tensor_count=2, src_tensor_count=3)) == _native.PARAM_INVALID
    status, msg = pb([1], [1], remote_cluster_id=999)
    assert status == _native.NOT_YET_LINK and "999" in msg
    status, msg = pb([1], [1], model_id=99)
    assert status == _native.KV_CACHE_NOT_EXIST and "model_id 99" in msg
    # Cache 3 is registered on the peer but not remote-accessible: never in its table.
    assert code(pb([], [1], remote_kind=1, cache_id=3)) == _native.KV_CACHE_NOT_EXIST
    status, msg = pb([BLOCKS], [1])
    assert status == _native.PARAM_INVALID and f"src_blocks[0]={BLOCKS}" in msg
    assert (
        code(pb([1], [1], src_tensor_first=TENSORS - 1, src_tensor_count=2, dst_tensor_count=2))
        == _native.PARAM_INVALID
    )
    assert code(pb([1], [1], remote_kind=5)) == _native.PARAM_INVALID
    assert code(pb([1], [1], timeout_ms=0)) == _native.PARAM_INVALID
    with pytest.raises(TypeError):
        pb(["x"], [1])
    status, msg = puller.engine.link(PEER_CLUSTER, "127.0.0.1", peer.port, TIMEOUT_MS)
    assert status == _native.ALREADY_LINK
    assert code(puller.engine.unlink(999, 1000, False)) == _native.NOT_YET_LINK
    assert (
        code(puller.engine.register_cache(DST_CACHE, [1 << 20], 4096, 1, True, True, -1, []))
        == _native.PARAM_INVALID
    )


def test_contiguous_dst_and_wrong_cluster(peer: NativePeer) -> None:
    p = Puller(101, "auto")
    try:
        row = np.zeros(8192, np.uint8)
        assert p.engine.register_cache(
            60, [row.ctypes.data], 8192, 1, False, True, -1, [(1, -1, 1)]
        ) == (0, "")
        status, _ = p.pull_blocks([1], [0], dst_cache_id=60)
        assert status == _native.PARAM_INVALID
        status, msg = p.engine.link(12, "127.0.0.1", peer.port, TIMEOUT_MS)
        assert status == _native.LINK_FAILED and "cluster 11" in msg
        assert p.engine.peer_transport(12) == ""
        assert p.engine.stats()["pulls"] >= 1
    finally:
        p.engine.close()
    p.engine.close()  # idempotent
    assert p.pull_blocks([1], [1])[0] == _native.ENGINE_FINALIZED


def test_broken_link_after_peer_failure() -> None:
    for transport in ("cma", "tcp"):
        victim = start_peer(
            PEER_CLUSTER + 1, tensors=TENSORS, blocks=BLOCKS, block_bytes=BLOCK_BYTES
        )
        p = Puller(102, transport)
        try:
            assert p.engine.link(PEER_CLUSTER + 1, "127.0.0.1", victim.port, TIMEOUT_MS) == (0, "")
            victim.process.kill()
            victim.process.wait(timeout=10)
            status, msg = p.pull_blocks([1], [1], cluster=PEER_CLUSTER + 1)
            assert status == _native.FAILED, (transport, msg)
            status, msg = p.pull_blocks([1], [1], cluster=PEER_CLUSTER + 1)
            assert status == _native.NOT_YET_LINK and "broken" in msg
            assert "unlink(force=True)" in msg
            assert p.engine.unlink(PEER_CLUSTER + 1, 1000, True) == (0, "")
        finally:
            p.engine.close()
            victim.stop()
