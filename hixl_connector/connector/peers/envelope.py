"""What every side-channel message carries around its body, and how a receiver checks it.

A request names the wire version and its destination: the prefill engine, TP rank and
incarnation (start nonce) it is for. P refuses a request of another version, or one for
another engine, rank or incarnation, before any handler runs; so a notice meant for rank 0,
or for the P that ran at this address before a restart, changes nothing here.

With an auth token, a request also carries a fresh nonce, its send time and an HMAC-SHA256
over all of it (destination included). P refuses a request without a valid HMAC, one sent
more than ``REPLAY_WINDOW_S`` away from its own clock, and one whose nonce it has accepted
before. A nonce is remembered until its send time leaves the window (send time + window, or
acceptance + window if later): a copy replayed at any moment its send time would still pass
is refused, whichever way the two hosts' clocks are off. The memory is bounded
(``MAX_REMEMBERED_NONCES``); at the bound P refuses new requests, it never forgets early.
Every reply carries the wire version and, with a token, an HMAC over its body and the
request's nonce, so a client takes no reply that a peer without the token made up or that
answers another request (and so was sent for another destination).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
from dataclasses import dataclass
from typing import Any

import msgpack

# Version 2: requests name their destination; nonces outlive a clock running ahead.
WIRE_VERSION = 2
MAX_MESSAGE_BYTES = 1 << 20
# A signed request sent further than this from the receiver's wall clock is refused:
# hosts' clocks must agree within it.
REPLAY_WINDOW_S = 30.0
# A nonce is held up to two windows (a send time one window ahead): this bounds the
# accepted signed requests to 2**18 per minute per P rank (~4,400 a second; ~40 MB at most).
MAX_REMEMBERED_NONCES = 1 << 18
NONCE_BYTES = 16


@dataclass(frozen=True)
class Destination:
    """The prefill engine rank a request is for: ``incarnation`` is its start nonce, so a P
    restarted at the same address (even under the same engine id) is another destination."""

    engine_id: str
    rank: int
    incarnation: int

    def to_wire(self) -> list[Any]:
        return [self.engine_id, self.rank, self.incarnation]

    def __str__(self) -> str:
        return f"engine {self.engine_id} rank {self.rank} incarnation {self.incarnation:x}"


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    value = msgpack.unpackb(
        frame,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_MESSAGE_BYTES,
        max_bin_len=MAX_MESSAGE_BYTES,
        max_array_len=1 << 16,
        max_map_len=1 << 12,
    )
    if not isinstance(value, dict):
        raise ValueError(f"expected a map, got {type(value).__name__}")
    return value


def signature(token: str, body: dict[str, Any], request_nonce: bytes = b"") -> bytes:
    """HMAC of a request (``request_nonce`` empty) or of a reply to the request that carried
    ``request_nonce``."""
    unsigned = {k: v for k, v in body.items() if k != "auth"}
    canonical = msgpack.packb([request_nonce, sorted(unsigned.items())], use_bin_type=True)
    return hmac.new(token.encode(), canonical, hashlib.sha256).digest()


def _authentic(token: str, body: dict[str, Any], request_nonce: bytes = b"") -> bool:
    """Whether ``body`` carries the HMAC ``signature`` gives it (compared in constant time)."""
    auth = body.get("auth")
    expected = signature(token, body, request_nonce)
    return isinstance(auth, bytes) and hmac.compare_digest(auth, expected)


def seal_request(
    message: dict[str, Any], seq: int, to: Destination, token: str, sent_at: float
) -> tuple[dict[str, Any], bytes]:
    """The request as sent, and its nonce (empty without a token)."""
    body = {**message, "seq": seq, "wire": WIRE_VERSION, "to": to.to_wire()}
    if not token:
        return body, b""
    nonce = os.urandom(NONCE_BYTES)
    body.update(nonce=nonce, sent_at=sent_at)
    body["auth"] = signature(token, body)
    return body, nonce


def seal_reply(reply: dict[str, Any], token: str, request_nonce: bytes) -> dict[str, Any]:
    sealed = {**reply, "wire": WIRE_VERSION}
    if token:
        sealed["auth"] = signature(token, sealed, request_nonce)
    return sealed


def reply_problem(reply: dict[str, Any], token: str, request_nonce: bytes) -> str:
    """ "" when the client may take ``reply``, else why not."""
    if reply.get("wire") != WIRE_VERSION:
        return (
            f"the peer speaks side-channel wire version {reply.get('wire', 1)!r}, this engine "
            f"{WIRE_VERSION}: run one hixl_connector release on prefill and decode"
        )
    if token and not _authentic(token, reply, request_nonce):
        return "unauthenticated reply"
    return ""


class RequestGate:
    """The server's checks of a request before any handler runs (one serving thread)."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._nonces = _Nonces()

    def refusal(self, message: dict[str, Any], me: Destination, now: float) -> str:
        """ "" when ``message`` may be served by ``me``, else why not (``now``: wall clock)."""
        if message.get("wire") != WIRE_VERSION:
            return (
                f"wire version {message.get('wire', 1)!r}, this engine speaks {WIRE_VERSION}: "
                "run one hixl_connector release on prefill and decode"
            )
        if self._token and not _authentic(self._token, message):
            return "authentication failed"
        to = message.get("to")
        if to != me.to_wire() and not _first_contact(message, me):
            if not me.incarnation:
                return "this prefill engine is still starting (no incarnation yet)"
            restarted = isinstance(to, list) and to[:2] == [me.engine_id, me.rank]
            why = " (the engine restarted since the request's params were issued)"
            return f"the request is for {_describe(to)}, this is {me}{why if restarted else ''}"
        if self._token:
            return self._nonces.fresh(message.get("nonce"), message.get("sent_at"), now)
        return ""


def _first_contact(message: dict[str, Any], me: Destination) -> bool:
    """A handshake naming this rank with incarnation 0, whatever engine id: a push-mode D
    knows P only by what the router sends (an engine id, possibly from P's previous start,
    and an address), and learns who serves there from this answer, which tells no more than
    P's params would."""
    to = message.get("to")
    return (
        message.get("type") == "handshake"
        and bool(me.incarnation)
        and isinstance(to, list)
        and len(to) == 3
        and to[1:] == [me.rank, 0]
        and isinstance(to[0], str)
    )


def _describe(to: Any) -> str:
    if (
        isinstance(to, list)
        and len(to) == 3
        and isinstance(to[0], str)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in to[1:])
    ):
        return str(Destination(to[0], to[1], to[2]))[:300]
    return f"no destination ({to!r:.100})"


class _Nonces:
    """The nonces of accepted requests, each until its send time leaves the window."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self._until: list[tuple[float, bytes]] = []  # (forget after, nonce), a heap

    def fresh(self, nonce: Any, sent_at: Any, now: float) -> str:
        """ "" when the request may be served, else why not; remembers an accepted nonce."""
        while self._until and self._until[0][0] < now:
            self._seen.discard(heapq.heappop(self._until)[1])
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return "missing nonce"
        if isinstance(sent_at, bool) or not isinstance(sent_at, (int, float)):
            return "missing send time"
        if not abs(now - sent_at) <= REPLAY_WINDOW_S:  # NaN fails too
            return (
                f"sent {now - sent_at:.0f} s off this host's clock ({REPLAY_WINDOW_S:g} s allowed)"
            )
        if nonce in self._seen:
            return "replayed request"
        if len(self._seen) >= MAX_REMEMBERED_NONCES:
            return (
                f"{MAX_REMEMBERED_NONCES} signed requests accepted within the replay window "
                "(the bound of the nonces held); try again later"
            )
        # Forgotten only once its send time is out of the window for good: then a copy is
        # refused by its time, whatever the clocks did meanwhile.
        heapq.heappush(self._until, (max(now, sent_at) + REPLAY_WINDOW_S, nonce))
        self._seen.add(nonce)
        return ""
