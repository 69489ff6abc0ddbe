"""D -> P notifications: round trips through msgpack, and clear errors for bad input."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.leases.messages import ITEM_FIELDS, LeaseNotice, Notification


def wire(message: dict[str, Any]) -> Any:
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


def notice(kind: str, request_id: str, lease_id: int) -> LeaseNotice:
    fields = ITEM_FIELDS[kind]
    consumers = 2 if "consumers" in fields else 1
    rank = 3 if "rank" in fields else 0
    return LeaseNotice(request_id, lease_id, consumers, rank)


@pytest.mark.parametrize("kind", sorted(ITEM_FIELDS))
def test_notification_round_trips(kind: str) -> None:
    note = Notification(kind, (notice(kind, "a", 1), notice(kind, "b", 2**64 - 1)))
    data = wire(note.to_dict())
    assert data["type"] == kind
    assert len(data["items"][0]) == len(ITEM_FIELDS[kind])
    assert Notification.from_dict(data) == note


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"type": "free", "items": []}, "type must be one of"),
        (
            {"type": "done", "items": [["a", 1]]},
            r"is not \[request_id, lease_id, consumers, rank\]",
        ),
        ({"type": "heartbeat", "items": [["a", 1, 2]]}, r"is not \[request_id, lease_id\]"),
        ({"type": "check", "items": [["a", 1, [1, 2]]]}, "type must be one of"),
        ({"type": "done", "items": [["a", -1, 1, 0]]}, "lease_id"),
        ({"type": "done", "items": [["a", 1, 0, 0]]}, "consumers"),
        ({"type": "done", "items": [["a", 1, 1, -1]]}, "rank"),
        ({"type": "done", "items": [["a", True, 1, 0]]}, "lease_id"),
        ({"type": "done", "items": [["", 1, 1, 0]]}, "request_id"),
        ({"type": "done", "items": [[1, 1, 1, 0]]}, "request_id"),
        ({"type": "done", "items": "a"}, "must be a list"),
        ({"type": "done", "items": [["a", 1, 1, 0]] * 4097}, "at most 4096"),
        (["done"], "must be a dict"),
    ],
)
def test_bad_notifications_raise_clear_errors(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Notification.from_dict(data)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@given(st.sampled_from(sorted(ITEM_FIELDS)), st.lists(_VALUES, max_size=4))
def test_any_decoded_value_is_accepted_or_refused_with_value_error(
    kind: str, items: list[Any]
) -> None:
    try:
        Notification.from_dict({"type": kind, "items": items})
    except ValueError:
        pass
