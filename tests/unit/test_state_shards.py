"""state_shards: a D rank's slices of P's states land every byte of its own state once,
for every TP pair, against states built the way vLLM shards them (vLLM's own shape
calculator for the per-rank shapes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from hixl_connector.connector.mapping.state_shards import (
    GATED_DELTA_NET,
    MAMBA2,
    Shard,
    ShardMismatch,
    granule_bytes,
    layer_shards,
    state_nbytes,
    state_slices,
)

TP_SIZES = (1, 2, 4, 8)


def rank_state(shards: list[Shard], tp: int, rank: int) -> bytes:
    """Rank ``rank``'s state: each piece's items it holds, in page order; byte values name
    the piece and item, so a byte from the wrong place shows."""
    out = bytearray()
    for index, shard in enumerate(shards):
        for item in shard.held(tp, rank):
            out += bytes((index * 61 + item * 7 + b) % 251 for b in range(shard.item_bytes))
    return bytes(out)


@st.composite
def sharded_states(draw: st.DrawFn) -> tuple[list[Shard], int, int]:
    p_tp, d_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    shards = []
    for _ in range(draw(st.integers(1, 5))):
        item_bytes = draw(st.integers(1, 12))
        if draw(st.booleans()) and not shards:
            shards.append(Shard(item_bytes, draw(st.integers(1, 3)), replicated=True))
        else:
            shards.append(Shard(item_bytes, max(p_tp, d_tp) * draw(st.integers(1, 4))))
    return draw(st.permutations(shards)), p_tp, d_tp


@given(sharded_states())
def test_every_byte_of_a_decode_rank_state_comes_from_where_prefill_holds_it(
    case: tuple[list[Shard], int, int],
) -> None:
    shards, p_tp, d_tp = case
    p_states = [rank_state(shards, p_tp, p) for p in range(p_tp)]
    for d_rank in range(d_tp):
        expected = rank_state(shards, d_tp, d_rank)
        landed = bytearray(len(expected))
        written = [0] * len(expected)
        slices = state_slices(shards, p_tp, d_tp, d_rank)
        for piece in slices:
            landed[piece.dst : piece.dst + piece.nbytes] = p_states[piece.p_rank][
                piece.src : piece.src + piece.nbytes
            ]
            for i in range(piece.dst, piece.dst + piece.nbytes):
                written[i] += 1
        assert bytes(landed) == expected
        assert written == [1] * len(expected)  # nothing twice, nothing left out
        assert len(expected) == state_nbytes(shards, d_tp)
        # Fewest slices: no two consecutive ones continue each other.
        for a, b in itertools.pairwise(slices):
            assert not (a.p_rank == b.p_rank and a.src + a.nbytes == b.src)
        # Every slice starts and ends on a multiple of the granule, on both sides.
        granule = granule_bytes(shards)
        for piece in slices:
            assert piece.src % granule == piece.dst % granule == piece.nbytes % granule == 0


@pytest.mark.parametrize("tp", TP_SIZES)
def test_between_equal_tp_sizes_a_state_is_one_slice_from_the_same_rank(tp: int) -> None:
    shards = [Shard(6, 16), Shard(12, 8, replicated=True), Shard(12, 8, True), Shard(4, 32)]
    for rank in range(tp):
        (piece,) = state_slices(shards, tp, tp, rank)
        assert (piece.p_rank, piece.src, piece.dst) == (rank, 0, 0)
        assert piece.nbytes == state_nbytes(shards, tp)


def test_items_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ShardMismatch, match="6 items do not divide between 4"):
        state_slices([Shard(2, 6)], 2, 4, 0)
    with pytest.raises(ShardMismatch, match="decode rank 2 of tp_size 2"):
        state_slices([Shard(2, 8)], 1, 2, 2)


MAMBA2_MODEL = {"intermediate_size": 256, "num_heads": 8, "head_dim": 32, "state_size": 64}


@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_mamba2_pieces_follow_vllm_shapes_at_every_tp_size(
    n_groups: int, conv_layout_ds: None
) -> None:
    """From vLLM's per-rank shapes at each TP size: the pieces add up to the rank's state,
    and describe the same model over the whole engine at every TP size."""
    whole = set()
    for tp in (1, 2, 4, 8):
        if n_groups != 1 and n_groups % tp:
            continue
        conv, ssm = MambaStateShapeCalculator.mamba2_state_shape(
            tp, n_groups=n_groups, conv_kernel=4, **MAMBA2_MODEL
        )
        assert conv[1] == 3  # DS: (channels, kernel - 1)
        shards = layer_shards(MAMBA2, conv, ssm, (2, 4), tp, n_groups)
        assert state_nbytes(shards, tp) == conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4
        whole.add(shards)
    assert len(whole) == 1
    (shards,) = whole
    assert shards[1].replicated == (n_groups == 1)


def test_mamba2_with_one_group_per_rank_needs_the_model_groups() -> None:
    conv, ssm = (256 // 2 + 2 * 64, 3), (4, 32, 64)
    with pytest.raises(ShardMismatch, match="n_groups None"):
        layer_shards(MAMBA2, conv, ssm, (2, 4), 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_delta_net_pieces_follow_vllm_shapes(tp: int, conv_layout_ds: None) -> None:
    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, num_k_heads=4, num_v_heads=8, head_k_dim=64, head_v_dim=32, conv_kernel_size=4
    )
    shards = layer_shards(GATED_DELTA_NET, conv, ssm, (2, 4), tp)
    q, k, v, recurrent = shards
    assert q == k == Shard(64 * 3 * 2, 4) and v == Shard(32 * 3 * 2, 8)
    assert recurrent == Shard(32 * 64 * 4, 8)
    assert state_nbytes(shards, tp) == conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4


def test_other_state_types_are_not_divided() -> None:
    with pytest.raises(ShardMismatch, match="not SHORT_CONV"):
        layer_shards("SHORT_CONV", (128, 2), (1, 1, 1), (2, 2), 1)
