"""D -> P messages about leased block sets, validated on arrival.

- done:      after a good read (the lease word vouched for it before and after): free now;
- release:   nothing will be pulled (full local hit, abort, failure): free now;
- heartbeat: still waiting for my turn: extend the leases.
P frees a lease once done/release notices arrived from `consumers` distinct D ranks (each
names its TP rank), so a repeated or lost-then-resent notice never counts a rank twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.limits import MAX_U64

MAX_NOTIFICATION_ITEMS = 4096

# The wire form of one item per kind.
ITEM_FIELDS = {
    "done": ("request_id", "lease_id", "consumers", "rank"),
    "release": ("request_id", "lease_id", "consumers", "rank"),
    "heartbeat": ("request_id", "lease_id"),
}
NOTIFICATION_KINDS = tuple(ITEM_FIELDS)


@dataclass(frozen=True)
class LeaseNotice:
    remote_request_id: str  # P's request id
    lease_id: int
    consumers: int = 1  # done/release: distinct D ranks P waits for before it frees
    rank: int = 0  # done/release: the D TP rank that sends it


@dataclass(frozen=True)
class Notification:
    kind: str
    items: tuple[LeaseNotice, ...]

    def __post_init__(self) -> None:
        if self.kind not in ITEM_FIELDS:
            raise ValueError(
                f"notification type must be one of {NOTIFICATION_KINDS}, got {self.kind!r}"
            )
        if len(self.items) > MAX_NOTIFICATION_ITEMS:
            raise ValueError(
                f"notification carries {len(self.items)} > {MAX_NOTIFICATION_ITEMS} items"
            )
        for item in self.items:
            if not isinstance(item.remote_request_id, str) or not item.remote_request_id:
                raise ValueError(
                    "notification field 'request_id' must be a non-empty string, "
                    f"got {item.remote_request_id!r}"
                )
            _check_int("lease_id", item.lease_id, 0, MAX_U64)
            _check_int("consumers", item.consumers, 1, 65535)
            _check_int("rank", item.rank, 0, 65534)

    def to_dict(self) -> dict[str, Any]:
        fields = ITEM_FIELDS[self.kind]
        rows = [[_field(item, name) for name in fields] for item in self.items]
        return {"type": self.kind, "items": rows}

    @classmethod
    def from_dict(cls, data: Any) -> Notification:
        if not isinstance(data, Mapping):
            raise ValueError(f"notification must be a dict, got {type(data).__name__}")
        kind = data.get("type")
        if kind not in ITEM_FIELDS:
            raise ValueError(f"notification type must be one of {NOTIFICATION_KINDS}, got {kind!r}")
        fields = ITEM_FIELDS[kind]
        rows = data.get("items")
        if not isinstance(rows, list) or len(rows) > MAX_NOTIFICATION_ITEMS:
            raise ValueError(
                f"notification items must be a list of at most "
                f"{MAX_NOTIFICATION_ITEMS} entries, got {rows!r:.200}"
            )
        items = []
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) != len(fields):
                raise ValueError(
                    f"{kind!r} notification item {row!r:.200} is not [{', '.join(fields)}]"
                )
            values = dict(zip(fields, row, strict=True))
            items.append(
                LeaseNotice(
                    values["request_id"],
                    values["lease_id"],
                    values.get("consumers", 1),
                    values.get("rank", 0),
                )
            )
        return cls(kind=kind, items=tuple(items))


def _field(item: LeaseNotice, name: str) -> Any:
    if name == "request_id":
        return item.remote_request_id
    return getattr(item, name)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"notification field {name!r} must be an int in [{low}, {high}], got {value!r}"
        )
