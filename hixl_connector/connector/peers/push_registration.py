"""Push mode's D -> P message: "write this request's blocks here", validated on arrival.

A D rank sends one ``push_register`` to the P rank it mirrors, on P's side channel, once it
has allocated the request's blocks and granted them to P's cluster. It names the request by
the base id P's request shares with D's (vllm-router sends both legs with one X-Request-Id),
which prompt positions land in which of D's blocks, the grant of each of D's registered KV
caches (in registration order), a word of D's that P writes last, under its own grant (D
takes the blocks as written once that word is set), and how long D waits. No positions: D
takes nothing (a local prefix hit, or the request ended first), and P frees its blocks at
once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.limits import MAX_CLUSTER_ID, MAX_KV_CACHE_GROUPS, check_field

MESSAGE_TYPE = "push_register"
MAX_PUSH_BLOCKS = 1 << 20
MAX_REQUEST_ID_CHARS = 1024
MAX_GRANT = 2**63 - 1
# D's wait for a push is its pull_timeout_s (config.MAX_TIMEOUT_S at most).
MAX_WAIT_S = (2**31 - 1) // 1000


@dataclass(frozen=True)
class PushRegistration:
    request: str  # the base request id (metadata.base_request_id)
    cluster_id: int  # D rank's cluster id: where P pushes
    positions: tuple[int, ...]  # prompt block positions P writes ...
    blocks: tuple[int, ...]  # ... into these blocks of D's
    grants: tuple[int, ...]  # D's grant for each of its registered KV caches
    word: tuple[int, int]  # (slot, grant) of D's push word, written last
    wait_s: float  # how long D waits for the push: P forgets the registration after that

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": MESSAGE_TYPE,
            "request": self.request,
            "cluster_id": self.cluster_id,
            "positions": list(self.positions),
            "blocks": list(self.blocks),
            "grants": list(self.grants),
            "word": list(self.word),
            "wait_s": self.wait_s,
        }

    @classmethod
    def from_dict(cls, data: Any) -> PushRegistration:
        where = "push registration"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
        request = check_field(where, "request", data, str)
        if len(request) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"{where} request id is longer than {MAX_REQUEST_ID_CHARS}")
        positions = _ints(where, "positions", data.get("positions"), MAX_PUSH_BLOCKS, 2**31)
        blocks = _ints(where, "blocks", data.get("blocks"), MAX_PUSH_BLOCKS, 2**31)
        if len(positions) != len(blocks):
            raise ValueError(f"{where} has {len(positions)} positions for {len(blocks)} blocks")
        grants = _ints(where, "grants", data.get("grants"), 4 * MAX_KV_CACHE_GROUPS, MAX_GRANT)
        word = _ints(where, "word", data.get("word"), 2, MAX_GRANT)
        if len(word) != 2:
            raise ValueError(f"{where} word must be [slot, grant], got {word!r}")
        if blocks and not grants:
            raise ValueError(f"{where} grants no cache for its {len(blocks)} blocks")
        wait_s = data.get("wait_s")
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 < wait_s <= MAX_WAIT_S
        ):
            raise ValueError(f"{where} field 'wait_s' must be seconds in (0, {MAX_WAIT_S}]")
        return cls(
            request=request,
            cluster_id=check_field(where, "cluster_id", data, int, 0, MAX_CLUSTER_ID),
            positions=positions,
            blocks=blocks,
            grants=grants,
            word=(word[0], word[1]),
            wait_s=float(wait_s),
        )


def _ints(where: str, name: str, value: Any, most: int, high: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > most:
        raise ValueError(f"{where} field {name!r} must be a list of at most {most} ints")
    for item in value:
        check_field(where, name, item, int, 0, high)
    return tuple(value)
