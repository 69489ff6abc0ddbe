"""The handshake payload: round trip, schema version, validation, compatibility hash."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from hixl_connector.connector.peers.handshake import (
    SCHEMA_VERSION,
    HandshakePayload,
    compatibility_hash,
    describe_mismatch,
)


def wire(message: dict[str, Any]) -> Any:
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


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
        "state_parts": [[1, 0, 36, 7], [2, 0, 36, 3], [2, 9216, 12, 12]],
        "kv_parts": [[768, 16, 16], [1792, 16, 16]],
        "incarnation": 0x5EED,
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
        ({"state_parts": 36}, "state_parts"),
        ({"state_parts": [[1, 0, 36]]}, "'state_parts' holds lists of 4 ints"),
        ({"state_parts": [[1, -1, 36, 7]]}, "state_parts"),
        ({"state_parts": [[64, 0, 36, 7]]}, "state_parts"),
        ({"state_parts": [[1, 0, 36, 0]]}, "state_parts"),
        ({"state_parts": [[1, 0, 2**48 + 1, 7]]}, "state_parts"),
        ({"state_parts": [[1, 0, 36, "7"]]}, "state_parts"),
        ({"state_parts": [[1, 0, 36, 7]] * 257}, "at most 256 parts"),
        ({"kv_parts": [[768, 16]]}, "'kv_parts' holds lists of 3 ints"),
        ({"kv_parts": [[768, 16, 0]]}, "kv_parts"),
        ({"kv_parts": [[768, 16, 16]] * 9}, "at most 8 parts"),
        ({"incarnation": -1}, "incarnation"),
        ({"incarnation": 2**64}, "incarnation"),
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


MLA_FIELDS = {**FIELDS, "kv_split": "replicated", "num_kv_heads": 1, "head_size": 576}


@pytest.mark.parametrize(("p_size", "d_size", "refused"), [(16, 16, False), (16, 32, True)])
def test_mla_reads_equal_block_sizes_and_refuses_others_naming_them(
    p_size: int, d_size: int, refused: bool
) -> None:
    """MLA's latent is not registered in slices, which assembling a D block out of smaller
    P blocks needs: unequal sizes are refused at the handshake, naming both and the layout."""
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.peers.compatibility import PeerError, check_compatible

    def mla(block_size: int, rank: int) -> HandshakePayload:
        fields = {"compatibility": MLA_FIELDS, "tp_rank": rank, "tp_size": 1}
        return HandshakePayload.from_dict(
            wire(payload_dict(**fields, block_sizes=[block_size], slice_bytes=0))
        )

    prefill = mla(p_size, 0)
    target = RemoteEndpoint("prefill-0", "10.0.0.1", 5701, 1, 4097, 0x5EED).rank(0)
    if not refused:
        check_compatible(target, prefill, mla(d_size, 0))
        return
    with pytest.raises(PeerError) as refusal:
        check_compatible(target, prefill, mla(d_size, 0))
    message = str(refusal.value)
    assert f"block_size [{p_size}]" in message and f"[{d_size}]" in message
    assert "LBHNC" in message and "use equal block sizes" in message


def test_kv_in_other_memory_is_refused_naming_both() -> None:
    """P's KV on an NPU and D's in host memory (or the reverse) would make every read
    host-to-device, which CANN serves only through a device memory pool: refused."""
    from hixl_connector.connector.endpoints import RemoteEndpoint
    from hixl_connector.connector.peers.compatibility import PeerError, check_compatible

    def side(memory: str) -> HandshakePayload:
        fields = {**FIELDS, "kv_memory": memory}
        return HandshakePayload.from_dict(
            wire(payload_dict(compatibility=fields, tp_rank=0, tp_size=1, units_per_block=2))
        )

    target = RemoteEndpoint("prefill-0", "10.0.0.1", 5701, 1, 4097, 0x5EED).rank(0)
    check_compatible(target, side("device"), side("device"))
    with pytest.raises(PeerError, match="kv_memory: local='host' remote='device'"):
        check_compatible(target, side("device"), side("host"))
