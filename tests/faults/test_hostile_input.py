"""Hostile input against a live prefill server: its side channel and its engine's TCP server.

Hypothesis generates thousands of inputs per run (``--fuzz-examples``): random bytes, wrong
msgpack schemas, wrong types in every field, truncated and oversized frames, signed and
unsigned. Every message must get an error reply (side channel) or an ERROR frame / a close
(engine), never a crash or a hang; afterwards the server still serves a real P/D request.
With the auth token configured, a peer without it neither handshakes nor reads a byte.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from engine.wire_client import (
    AUTH,
    CHALLENGE,
    DATA,
    HEADER,
    MAGIC,
    TABLE,
    TABLE_REQ,
    VERSION,
    WELCOME,
    client_proof,
    frame,
    read_request,
    recv_frame,
    send_hello,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl_connector.connector.peers.envelope import (
    NONCE_BYTES,
    WIRE_VERSION,
    Destination,
    signature,
)
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION
from hixl_connector.connector.peers.side_channel import SideChannelClient, SideChannelError

from .deployments import AUTH_TOKEN
from .fault_harness import Servers, plain, prefill_leg, run_decode, token_prompt

REPLY_TIMEOUT_MS = 3000
KINDS = ["handshake", "check", "done", "release", "heartbeat"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
items = st.lists(st.lists(values, min_size=1, max_size=4), max_size=4) | values
messages = st.fixed_dictionaries(
    {"type": st.sampled_from([*KINDS, "bogus"]) | scalars, "seq": st.integers(0, 2**40)},
    optional={"items": items, "schema": values, "auth": values},
)


@pytest.fixture(scope="module")
def prefill(lease_pd: Servers) -> Servers:
    return lease_pd


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture(scope="module")
def rank_zero(context: zmq.Context, prefill: Servers) -> Destination:
    """P's rank 0 as its kv_transfer_params name it (one prefill leg, released at once)."""
    params = prefill_leg(prefill["prefill"], token_prompt(40, seed=69))
    to = Destination(params["remote_engine_id"], 0, params["remote_incarnation"])
    trusted = client(context, prefill, AUTH_TOKEN, to)
    item = [params["remote_request_id"], params["remote_lease_id"], 1, 0]
    # "early" when the release overtakes the start of the lease on P's next step
    assert trusted.request({"type": "release", "items": [item]})["results"][0] in (
        "finished",
        "early",
    )
    trusted.close()
    return to


@pytest.fixture(scope="module")
def dealer(context: zmq.Context, prefill: Servers) -> Iterator[zmq.Socket]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{prefill.config('prefill')['side_channel_port']}")
    yield sock
    sock.close(linger=0)


def ask(sock: zmq.Socket, frame: bytes) -> dict[str, Any]:
    sock.send_multipart([b"", frame])
    assert sock.poll(REPLY_TIMEOUT_MS, zmq.POLLIN), "the side channel did not answer"
    reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    return reply


def client(
    context: zmq.Context, prefill: Servers, token: str, to: Destination
) -> SideChannelClient:
    port = prefill.config("prefill")["side_channel_port"]
    return SideChannelClient(context, "127.0.0.1", port, to, 3.0, token)


def still_serves(prefill: Servers, seed: int) -> None:
    prompt = token_prompt(90, seed)
    result = run_decode(prefill["decode"], prompt, prefill_leg(prefill["prefill"], prompt), 60.0)
    assert result.error is None, result.error
    assert result.tokens == plain(prefill["prefill"], prompt)


def test_side_channel_survives_fuzzing(
    prefill: Servers, dealer: zmq.Socket, rank_zero: Destination, fuzz_examples: int
) -> None:
    @settings(max_examples=fuzz_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(raw=st.binary(max_size=512))
    def random_bytes(raw: bytes) -> None:
        assert ask(dealer, raw)["ok"] is False

    @settings(max_examples=fuzz_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(message=messages, sign=st.booleans(), cut=st.integers(0, 64))
    def wrong_schemas(message: dict[str, Any], sign: bool, cut: int) -> None:
        if sign:  # a valid envelope signed with the real token, so it reaches the handlers
            message.update(wire=WIRE_VERSION, to=rank_zero.to_wire(), sent_at=time.time())
            message["nonce"] = os.urandom(NONCE_BYTES)
            message["auth"] = signature(AUTH_TOKEN, message)
        frame = msgpack.packb(message, use_bin_type=True)
        reply = ask(dealer, frame[: len(frame) - cut] if cut < len(frame) else frame)
        if not sign:
            assert reply["ok"] is False

    random_bytes()
    wrong_schemas()
    # An oversized frame is dropped by ZMQ (connection closed, no reply) ...
    dealer.send_multipart([b"", b"\x81" + os.urandom(2 << 20)])
    assert not dealer.poll(500, zmq.POLLIN)
    still_serves(prefill, seed=70)


def test_side_channel_refuses_peers_without_the_token(
    context: zmq.Context, prefill: Servers, rank_zero: Destination
) -> None:
    hello = {"type": "handshake", "schema": SCHEMA_VERSION}
    for token in ("", "wrong-token"):
        anonymous = client(context, prefill, token, rank_zero)
        with pytest.raises(SideChannelError, match="authentication failed"):
            anonymous.request(hello)
        anonymous.close()
    trusted = client(context, prefill, AUTH_TOKEN, rank_zero)
    assert trusted.request(hello)["payload"]["engine_port"] > 0
    trusted.close()


def engine_address(
    context: zmq.Context, prefill: Servers, rank_zero: Destination
) -> tuple[tuple[str, int], int]:
    """((host, port), cluster id) of P's engine, from an authenticated handshake."""
    trusted = client(context, prefill, AUTH_TOKEN, rank_zero)
    payload = trusted.request({"type": "handshake", "schema": SCHEMA_VERSION})["payload"]
    trusted.close()
    return (str(payload["engine_host"]), int(payload["engine_port"])), int(payload["cluster_id"])


def frames_until_close(sock: socket.socket, timeout_s: float = 6.0) -> list[int]:
    """Frame types the server sends until it closes (or goes quiet)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    kinds = []
    while len(data) >= HEADER.size:
        _, _, kind, length = HEADER.unpack_from(data)
        kinds.append(kind)
        data = data[HEADER.size + length :]
    return kinds


def authenticate(sock: socket.socket, token: str, cluster: int) -> None:
    """Sends HELLO and AUTH with `token`, without waiting for the server's verdict."""
    client_nonce = send_hello(sock, cluster)
    kind, payload = recv_frame(sock)
    assert kind == CHALLENGE
    sock.sendall(frame(AUTH, client_proof(token, payload[1:33], client_nonce)))


def test_engine_refuses_peers_without_the_token(
    context: zmq.Context, prefill: Servers, rank_zero: Destination
) -> None:
    address, cluster = engine_address(context, prefill, rank_zero)
    for token in ("", "wrong-token"):
        with socket.create_connection(address, timeout=5) as sock:
            try:
                authenticate(sock, token, cluster)
                sock.sendall(frame(TABLE_REQ) + read_request(1, (4096, 64)))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server hung up first
            kinds = frames_until_close(sock)
        assert not {WELCOME, TABLE, DATA} & set(kinds), kinds
    with socket.create_connection(address, timeout=5) as sock:  # no handshake at all
        sock.sendall(read_request(1, (4096, 64)))
        sock.shutdown(socket.SHUT_WR)
        assert DATA not in frames_until_close(sock)


def test_engine_server_survives_fuzzing(
    context: zmq.Context, prefill: Servers, rank_zero: Destination, fuzz_examples: int
) -> None:
    address, cluster = engine_address(context, prefill, rank_zero)

    @settings(max_examples=fuzz_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(
        authenticated=st.booleans(),
        kind=st.integers(0, 20),
        payload=st.binary(max_size=256),
        declared=st.none() | st.integers(0, 2**64 - 1),
        raw=st.none() | st.binary(min_size=1, max_size=64),
    )
    def hostile(
        authenticated: bool, kind: int, payload: bytes, declared: int | None, raw: bytes | None
    ) -> None:
        with socket.create_connection(address, timeout=5) as sock:
            if authenticated:
                authenticate(sock, AUTH_TOKEN, cluster)
            length = len(payload) if declared is None else declared
            data = raw if raw is not None else HEADER.pack(MAGIC, VERSION, kind, length) + payload
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)  # truncated frames end here, not after 5 s
            except OSError:
                pass  # the server refused the frame and hung up
            kinds = frames_until_close(sock)
        if not authenticated:
            assert not {WELCOME, TABLE, DATA} & set(kinds), kinds

    hostile()
    still_serves(prefill, seed=71)
