"""The one rank -> ports / cluster id mapping: layout of the windows and its range checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.endpoints import (
    CLUSTER_ID_STEP,
    RemoteEndpoint,
    cluster_id_at,
    port_at,
    rank_address,
    rank_position,
)
from hixl_connector.connector.limits import MAX_CLUSTER_ID, MAX_PORT


@dataclass(frozen=True)
class Bases:
    side_channel_port: int = 6000
    engine_port: int = 7000
    cluster_id_base: int = 4096


@st.composite
def ranks(draw: st.DrawFn) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, tp_size) whose position fits an engine's window."""
    tp_size = draw(st.integers(1, 64))
    dp_rank = draw(st.integers(0, CLUSTER_ID_STEP // tp_size - 1))
    return dp_rank, draw(st.integers(0, tp_size - 1)), tp_size


@given(ranks())
def test_every_rank_of_an_engine_gets_its_own_position_and_addresses(
    rank: tuple[int, int, int],
) -> None:
    dp_rank, tp_rank, tp_size = rank
    address = rank_address(Bases(), dp_rank, tp_rank, tp_size)
    position = dp_rank * tp_size + tp_rank
    assert rank_position(dp_rank, tp_rank, tp_size) == position < CLUSTER_ID_STEP
    assert address.cluster_id == 4096 + position
    assert address.side_channel_port == 6000 + position
    assert address.engine_port == 7000 + position


@given(st.integers(1, 64), st.integers(0, 15))
def test_positions_of_one_engine_are_distinct_and_dense(tp_size: int, dp_ranks: int) -> None:
    dp_ranks = min(dp_ranks, CLUSTER_ID_STEP // tp_size - 1)
    positions = [
        rank_position(dp, tp, tp_size) for dp in range(dp_ranks + 1) for tp in range(tp_size)
    ]
    assert sorted(positions) == list(range(len(positions)))


@given(st.integers(1, MAX_PORT), st.integers(0, CLUSTER_ID_STEP - 1))
def test_a_port_is_returned_only_when_it_exists(base: int, position: int) -> None:
    if base + position <= MAX_PORT:
        assert port_at("side_channel_port", base, position) == base + position
    else:
        with pytest.raises(ValueError, match=f"side_channel_port {base} .* > {MAX_PORT}"):
            port_at("side_channel_port", base, position)


@given(st.integers(MAX_CLUSTER_ID - 2 * CLUSTER_ID_STEP, MAX_CLUSTER_ID), st.integers(0, 1023))
def test_a_cluster_id_is_returned_only_when_it_is_an_int64(base: int, position: int) -> None:
    if base + position <= MAX_CLUSTER_ID:
        assert cluster_id_at("cluster_id_base", base, position) == base + position
    else:
        with pytest.raises(ValueError, match=f"cluster id {base + position} > {MAX_CLUSTER_ID}"):
            cluster_id_at("cluster_id_base", base, position)


def test_engine_port_zero_means_any_free_port_on_every_rank() -> None:
    assert rank_address(Bases(engine_port=0), 3, 1, 4).engine_port == 0


@pytest.mark.parametrize(
    ("bases", "rank", "message"),
    [
        (Bases(), (0, 2, 2), "tp_rank 2 is out of range for tp_size 2"),
        (Bases(), (-1, 0, 2), "dp_rank must be an int >= 0"),
        (Bases(), (0, True, 2), "tp_rank must be an int"),
        (Bases(), (0, 0, 0), "tp_size must be an int >= 1"),
        (Bases(), (1, 0, CLUSTER_ID_STEP), "at most 1024 ranks"),
        (Bases(side_channel_port=MAX_PORT), (0, 1, 2), "side_channel_port 65535 .* 65536"),
        (Bases(engine_port=MAX_PORT - 1), (1, 1, 2), "engine_port 65534 .* 65537"),
        (Bases(engine_port=MAX_PORT + 1), (0, 0, 1), r"engine_port must be an int in \[0, 65535"),
        (Bases(cluster_id_base=MAX_CLUSTER_ID), (0, 1, 2), "gives cluster id"),
        (Bases(cluster_id_base=-1), (0, 0, 1), "cluster_id_base must be an int"),
    ],
)
def test_out_of_range_ranks_and_bases_are_refused_naming_them(
    bases: Bases, rank: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rank_address(bases, *rank)


def test_d_finds_each_prefill_rank_from_rank_zero_with_the_same_mapping() -> None:
    prefill = rank_address(Bases(), 1, 0, 4)  # P's rank 0 of DP rank 1, as its params say
    remote = RemoteEndpoint("p", "10.0.0.1", prefill.side_channel_port, 4, prefill.cluster_id)
    for tp_rank in range(4):
        expected = rank_address(Bases(), 1, tp_rank, 4)
        target = remote.rank(tp_rank)
        assert (target.port, target.cluster_id) == (
            expected.side_channel_port,
            expected.cluster_id,
        )


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        (RemoteEndpoint("p", "h", MAX_PORT, 2, 0), "prefill engine p: remote_port 65535"),
        (RemoteEndpoint("p", "h", 5701, 2, MAX_CLUSTER_ID), "prefill engine p: remote_cluster_id"),
    ],
)
def test_d_refuses_a_prefill_rank_out_of_range(remote: RemoteEndpoint, message: str) -> None:
    remote.rank(0)
    with pytest.raises(ValueError, match=message):
        remote.rank(1)
