"""What crosses process boundaries: params, handshake payload, notifications, metadata."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import pytest

from hixl_connector.connector.metadata import (
    SCHEMA_VERSION,
    HandshakePayload,
    HixlConnectorMetadata,
    InvalidTransferParams,
    RecvSpec,
    ReleaseSpec,
    RemoteEndpoint,
    SendSpec,
    build_remote_decode_params,
    compatibility_hash,
    describe_mismatch,
    parse_remote_prefill,
)

P = RemoteEndpoint("prefill-0", "10.0.0.1", 5701, 2, 4096)


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
        ({"transfer_mode": "push"}, "transfer_mode"),
        ({"dcp_size": 2}, "dcp_size"),
        ({"pp_size": 2}, "pp_size"),
        ({"remote_num_tokens": -3}, "remote_num_tokens"),
    ],
)
def test_bad_params_raise_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTransferParams, match=message):
        parse_remote_prefill(p_params(**overrides))


def test_params_are_not_a_dict() -> None:
    with pytest.raises(InvalidTransferParams, match="must be a dict"):
        parse_remote_prefill(["do_remote_prefill"])  # type: ignore[arg-type]


# --- scheduler -> worker metadata


def test_connector_metadata_pickles() -> None:
    meta = HixlConnectorMetadata(
        to_recv=[RecvSpec("d", "p", 1, P, (4, 5), (8, 9))],
        to_release=[ReleaseSpec("d2", "p2", 2, P)],
        to_send=[SendSpec("p3", 3, 7, 0xABC)],
        heartbeats=[(P, "p", 1)],
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert HixlConnectorMetadata().to_recv == []


# --- handshake

FIELDS: dict[str, Any] = {
    "model": "/models/tiny",
    "dtype": "float32",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 32,
    "kv_layout": "LBHNC",
    "kv_split": "heads",
    "unit_token_bytes": 512,
    "tensors_per_layer": 1,
    "num_tensors": 2,
}


def payload_dict(**overrides: Any) -> dict[str, Any]:
    fields = overrides.pop("compatibility", FIELDS)
    data = {
        "schema_version": SCHEMA_VERSION,
        "compatibility": fields,
        "engine_id": "prefill-0",
        "tp_rank": 1,
        "tp_size": 2,
        "cluster_id": 4097,
        "engine_host": "10.0.0.1",
        "engine_port": 40000,
        "num_blocks": 1024,
        "units_per_block": 1,
        "block_sizes": [16],
        "slice_bytes": 128,
    }
    data.update(overrides)
    if "compatibility_hash" not in data:
        data["compatibility_hash"] = compatibility_hash(fields)
    return data


def test_payload_round_trips_through_msgpack() -> None:
    payload = HandshakePayload.from_dict(payload_dict())
    assert HandshakePayload.from_dict(wire(payload.to_dict())) == payload
    assert payload.compatibility == FIELDS


def test_extra_compatibility_fields_are_hashed_and_kept() -> None:
    fields = FIELDS | {"block_shape": [2, 16, 64], "kv_cache_dtype": "auto"}
    payload = HandshakePayload.from_dict(wire(payload_dict(compatibility=fields)))
    assert payload.compatibility["block_shape"] == [2, 16, 64]
    assert compatibility_hash(fields) != compatibility_hash(FIELDS)


def test_other_schema_version_is_refused_clearly() -> None:
    other = SCHEMA_VERSION + 1
    with pytest.raises(
        ValueError, match=f"schema version {other} but this side speaks {SCHEMA_VERSION}"
    ):
        HandshakePayload.from_dict(payload_dict(schema_version=other))
    with pytest.raises(ValueError, match="schema version None"):
        HandshakePayload.from_dict({"engine_id": "x"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tp_rank": 2}, "tp_rank 2 is out of range"),
        ({"engine_port": 0}, "engine_port"),
        ({"num_blocks": "1024"}, "num_blocks"),
        ({"cluster_id": -1}, "cluster_id"),
        ({"engine_id": ""}, "engine_id"),
        ({"compatibility_hash": "0" * 64}, "does not match its own fields"),
        ({"extra": 1}, r"unknown \['extra'\]"),
        ({"compatibility": FIELDS | {"unit_token_bytes": 0}}, "unit_token_bytes"),
        ({"block_sizes": []}, "block_sizes"),
        ({"block_sizes": [16, 0]}, "block_sizes"),
        ({"block_sizes": 16}, "block_sizes"),
        ({"slice_bytes": -1}, "slice_bytes"),
        ({"compatibility": FIELDS | {"kv_split": "rows"}}, "kv_split"),
        ({"units_per_block": 0}, "units_per_block"),
        ({"compatibility": {k: v for k, v in FIELDS.items() if k != "dtype"}}, "'dtype'"),
        ({"compatibility": FIELDS | {"blob": b"raw"}, "compatibility_hash": ""}, "non-primitive"),
    ],
)
def test_bad_payload_raises_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HandshakePayload.from_dict(payload_dict(**overrides))


def test_payload_missing_field_is_named() -> None:
    data = payload_dict()
    del data["num_blocks"]
    with pytest.raises(ValueError, match=r"missing \['num_blocks'\]"):
        HandshakePayload.from_dict(data)


def test_compatibility_hash_is_canonical() -> None:
    reordered = dict(reversed(list(FIELDS.items())))
    assert compatibility_hash(reordered) == compatibility_hash(FIELDS)
    assert len(compatibility_hash(FIELDS)) == 64
    for name in FIELDS:
        changed = FIELDS | {name: FIELDS[name] * 2}
        assert compatibility_hash(changed) != compatibility_hash(FIELDS), name


def test_describe_mismatch_names_each_field_with_both_values() -> None:
    remote = FIELDS | {"unit_token_bytes": 256, "dtype": "bfloat16", "only_remote": 1}
    text = describe_mismatch(FIELDS, remote)
    assert "unit_token_bytes: local=512 remote=256" in text
    assert "dtype: local='float32' remote='bfloat16'" in text
    assert "only_remote: local='<missing>' remote=1" in text
    assert "num_layers" not in text
    assert describe_mismatch(FIELDS, dict(FIELDS)) == ""


def test_compatibility_hash_refuses_non_plain_values() -> None:
    with pytest.raises(ValueError, match="plain values"):
        compatibility_hash({"blob": b"raw"})
