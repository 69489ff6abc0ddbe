"""What crosses process boundaries: kv_transfer_params and the scheduler -> worker metadata."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.metadata import (
    HixlConnectorMetadata,
    RecvSpec,
    ReleaseSpec,
    SendSpec,
    WaitingRead,
)
from hixl_connector.connector.transfer_params import (
    REQUIRED_PARAMS,
    InvalidTransferParams,
    build_remote_decode_params,
    parse_remote_prefill,
)

P = RemoteEndpoint("prefill-0", "10.0.0.1", 5701, 2, 4096, incarnation=2**63 + 5)


def wire(message: dict[str, Any]) -> Any:
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


def p_params(**overrides: Any) -> dict[str, Any]:
    params = build_remote_decode_params(P, "req-1", [[7, 8, 9]], 40, (2**40, 3), [16])
    params.update(overrides)
    return params


# --- kv_transfer_params


def test_params_round_trip_through_json_like_wire() -> None:
    prefill = parse_remote_prefill(wire(p_params()))
    assert prefill.remote == P
    assert (prefill.remote_request_id, prefill.lease_id) == ("req-1", 2**40)
    assert prefill.lease_slot == 3
    assert prefill.block_ids == ((7, 8, 9),) and prefill.num_tokens == 40
    assert prefill.block_sizes == (16,)


def test_prefill_block_sizes_are_optional_and_checked() -> None:
    params = p_params()
    del params["remote_block_size"]
    assert parse_remote_prefill(params).block_sizes is None
    for bad in ([16, 16], [0], ["16"], 16):
        with pytest.raises(InvalidTransferParams, match="remote_block_size"):
            parse_remote_prefill(p_params(remote_block_size=bad))


def test_flat_block_list_is_accepted() -> None:
    assert parse_remote_prefill(p_params(remote_block_ids=[3, 4])).block_ids == ((3, 4),)
    assert parse_remote_prefill(p_params(remote_block_ids=[[]])).block_ids == ((),)


def test_one_block_list_per_kv_cache_group() -> None:
    groups = [[3, 4, 5], [0, 9, 10]]  # a sliding-window group: its first block dropped (0)
    params = p_params(remote_block_ids=groups, remote_block_size=[16, 16])
    assert parse_remote_prefill(params).block_ids == (
        (3, 4, 5),
        (0, 9, 10),
    )


def test_missing_fields_are_all_named() -> None:
    params = p_params()
    del params["remote_lease_id"], params["remote_host"]
    with pytest.raises(InvalidTransferParams, match="remote_host, remote_lease_id"):
        parse_remote_prefill(params)


def test_params_of_a_p_without_incarnations_are_refused_naming_the_field() -> None:
    params = p_params()
    del params["remote_incarnation"]
    with pytest.raises(InvalidTransferParams, match="lack required field.*remote_incarnation"):
        parse_remote_prefill(params)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"remote_block_ids": [[1]] * 65}, "65 KV cache groups"),
        ({"remote_block_ids": [[1], [2, -1]]}, "-1"),
        ({"remote_block_ids": [1, -2]}, "-2"),
        ({"remote_block_ids": [1, True]}, "True"),
        ({"remote_block_ids": "1,2"}, "must be a list"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": "5701"}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_lease_id": -1}, "remote_lease_id"),
        ({"remote_cluster_id": 1.5}, "remote_cluster_id"),
        ({"transfer_mode": "write"}, "transfer_mode"),
        ({"dcp_size": 2}, "dcp_size"),
        ({"pp_size": 2}, "pp_size"),
        ({"remote_num_tokens": -3}, "remote_num_tokens"),
        ({"remote_incarnation": 0}, "remote_incarnation"),
        ({"remote_incarnation": 2**64}, "remote_incarnation"),
        ({"remote_incarnation": "5"}, "remote_incarnation"),
    ],
)
def test_bad_params_raise_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTransferParams, match=message):
        parse_remote_prefill(p_params(**overrides))


@given(
    st.sets(st.sampled_from(REQUIRED_PARAMS), min_size=1),
    st.dictionaries(
        st.sampled_from(sorted(p_params())), st.one_of(st.none(), st.text(), st.integers())
    ),
)
def test_every_refusal_names_the_field_and_the_engine_the_params_name(
    missing: set[str], garbled: dict[str, Any]
) -> None:
    params = {**p_params(), **garbled}
    for key in missing:
        params.pop(key)
    with pytest.raises(InvalidTransferParams) as refused:
        parse_remote_prefill(params)
    message = str(refused.value)
    assert all(key in message for key in missing)
    if params.get("remote_engine_id") is None and params.get("remote_host") is None:
        assert message.endswith("(they name no prefill engine)")
    else:
        assert f"sent for prefill engine {params.get('remote_engine_id')!r:.80}" in message
    assert len(message) < 2000  # hostile values stay bounded


def test_params_are_not_a_dict() -> None:
    with pytest.raises(InvalidTransferParams, match="must be a dict"):
        parse_remote_prefill(["do_remote_prefill"])  # type: ignore[arg-type]


# --- scheduler -> worker metadata


def test_connector_metadata_pickles() -> None:
    meta = HixlConnectorMetadata(
        to_recv=[RecvSpec("d", "p", 1, P, (4, 5), (8, 9))],
        to_release=[ReleaseSpec("d2", "p2", 2, P)],
        to_send=[SendSpec("p3", 3, 7, 0xABC)],
        waiting=[WaitingRead("d3", P, "p", 1)],
        done_waiting=["d4"],
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert HixlConnectorMetadata().to_recv == []
