"""Push mode's D -> P question "did you give up on any of these pushes?" and P's answer,
both validated on arrival.

A D rank waiting for P's word asks the P rank it registered with, on P's side channel, about
the requests it still waits for (by base request id), every ``PUSH_CHECK_S`` while any has
waited that long. P answers with those it gave up on (a write failed, its prefill's lease
ended first), each with why and whether the link P writes over is lost (D then links again
before its next request there). No answer within ``handshake_timeout_s``, or a refusal (P
restarted: its side channel refuses the old incarnation), tells D the P rank is gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.limits import MAX_CLUSTER_ID, check_field
from hixl_connector.connector.push.registration import MAX_REQUEST_ID_CHARS

MESSAGE_TYPE = "push_status"
# A D rank waits for at most this many pushes from one P rank at once (its push words).
MAX_ASKED = 65536
MAX_REASON_CHARS = 1024
# How often a D rank asks a P rank about the pushes it waits for, at most.
PUSH_CHECK_S = 0.5


@dataclass(frozen=True)
class GaveUp:
    """P will not write this push: ``reason``; ``relink``: the link it writes over is lost."""

    reason: str
    relink: bool


@dataclass(frozen=True)
class PushStatusQuery:
    cluster_id: int  # the asking D rank's: where P's pushes for it go
    requests: tuple[str, ...]  # base request ids D waits for

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": MESSAGE_TYPE,
            "cluster_id": self.cluster_id,
            "requests": list(self.requests),
        }

    @classmethod
    def from_dict(cls, data: Any) -> PushStatusQuery:
        where = "push status query"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
        requests = data.get("requests")
        if not isinstance(requests, (list, tuple)) or len(requests) > MAX_ASKED:
            raise ValueError(f"{where} field 'requests' must list at most {MAX_ASKED} ids")
        for request in requests:
            if not isinstance(request, str) or len(request) > MAX_REQUEST_ID_CHARS:
                raise ValueError(
                    f"{where} request ids must be strings of at most {MAX_REQUEST_ID_CHARS}"
                )
        return cls(
            cluster_id=check_field(where, "cluster_id", data, int, 0, MAX_CLUSTER_ID),
            requests=tuple(requests),
        )


def answer(gave_up: Mapping[str, GaveUp]) -> dict[str, Any]:
    """P's reply: the asked pushes it gave up on."""
    return {"gave_up": {request: [g.reason, g.relink] for request, g in gave_up.items()}}


def gave_up_in(reply: Any, asked: Sequence[str]) -> dict[str, GaveUp]:
    """The pushes P's ``reply`` says it gave up on, of those ``asked``; raises ValueError
    for a malformed reply or one naming a request not asked about."""
    where = "push status answer"
    gave_up = reply.get("gave_up") if isinstance(reply, Mapping) else None
    if not isinstance(gave_up, Mapping):
        raise ValueError(f"{where} must carry a dict 'gave_up'")
    wanted = set(asked)
    parsed = {}
    for request, value in gave_up.items():
        if request not in wanted:
            raise ValueError(f"{where} names request {request!r:.80}, which was not asked about")
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not isinstance(value[0], str)
            or not isinstance(value[1], bool)
        ):
            raise ValueError(f"{where} entry for {request!r:.80} must be [reason, relink]")
        parsed[request] = GaveUp(value[0][:MAX_REASON_CHARS], value[1])
    return parsed
