"""The side channel over real ZMQ sockets on loopback: replies, refusals, timeouts, auth."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import zmq
from loopback import has_ipv6_loopback
from raw_side_channel import raw_request

from hixl_connector.connector.peers.envelope import Destination, seal_request, signature
from hixl_connector.connector.peers.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelRefused,
    SideChannelServer,
    SideChannelTimeout,
)

# Both as long as a real token must be, so the refusal comes from the HMAC, not the length.
TOKEN = "side-channel-test-token-0123456789abcdef"
WRONG_TOKEN = "side-channel-wrong-token-0123456789abcdef"
ME = Destination("p", 0, 0xA1)  # the prefill rank the servers here play


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    return {"echo": message["value"]}


def _serve(context: zmq.Context, token: str = "") -> SideChannelServer:
    return SideChannelServer(context, "127.0.0.1", 0, {"echo": _echo}, lambda: ME, token)


def test_request_reply_and_handler_errors(context: zmq.Context) -> None:
    server = _serve(context)
    client = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=2)
    try:
        assert client.request({"type": "echo", "value": [1, "a"]})["echo"] == [1, "a"]
        with pytest.raises(SideChannelError, match="unknown type 'nope'"):
            client.request({"type": "nope"})
        with pytest.raises(SideChannelError, match="bad echo"):
            client.request({"type": "echo"})  # KeyError in the handler
        assert client.request({"type": "echo", "value": 3})["echo"] == 3
    finally:
        client.close()
        server.close()


def test_a_closed_client_raises_and_opens_no_socket(context: zmq.Context) -> None:
    """A client someone closed (a peer replaced while a lane held it) sends nothing again;
    before, it made a socket no one owned, and Context.term() then waited forever."""
    server = _serve(context)
    client = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=2)
    try:
        assert client.request({"type": "echo", "value": 1})["echo"] == 1
        client.close()
        with pytest.raises(SideChannelError, match="is closed; 'echo' not sent"):
            client.request({"type": "echo", "value": 2})
        assert client._socket is None
    finally:
        server.close()
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(5.0)
    assert not ended.is_alive(), "zmq.Context.term() waits for a socket no one closes"


def test_timeout_is_bounded_and_client_recovers(context: zmq.Context) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]
    client = SideChannelClient(context, "127.0.0.1", port, ME, timeout_s=0.2)
    try:
        with pytest.raises(SideChannelError, match="no reply"):
            client.request({"type": "echo", "value": 1})
    finally:
        client.close()
        silent.close()


SLOW_SERVER = """
import threading, zmq
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.side_channel import SideChannelServer
server = SideChannelServer(zmq.Context(), "127.0.0.1", 0,
                           {"slow": lambda m: threading.Event().wait(60) or {}},
                           lambda: Destination("p", 0, 0xA1))
print(server.port, flush=True)
threading.Event().wait(60)
"""


def test_a_refused_or_closed_connection_fails_the_request_at_once(
    context: zmq.Context,
) -> None:
    """A dead peer's host refuses the connection, or closes it under a request waiting for
    its reply: the request fails in well under its timeout (as a timeout: the peer is gone).
    A silent peer that keeps the connection open still takes the whole timeout."""
    nothing = socket.socket()
    nothing.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    client = SideChannelClient(context, "127.0.0.1", nothing.getsockname()[1], ME, timeout_s=5)
    try:
        began = time.monotonic()
        with pytest.raises(SideChannelRefused, match="refused the connection while 'echo'"):
            client.request({"type": "echo", "value": 1})
        assert time.monotonic() - began < 1.0
    finally:
        client.close()
        nothing.close()
    # A server in a process of its own, killed while it holds a request unanswered.
    serving = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert serving.stdout is not None
        port = int(serving.stdout.readline())
        client = SideChannelClient(context, "127.0.0.1", port, ME, timeout_s=5)
        threading.Timer(0.3, serving.kill).start()
        began = time.monotonic()
        with pytest.raises(SideChannelTimeout) as lost:
            client.request({"type": "slow"})
        assert isinstance(lost.value, SideChannelRefused), lost.value
        assert 0.25 < time.monotonic() - began < 2.0
        client.close()
    finally:
        serving.kill()
        serving.wait(5)


def test_a_connection_lost_before_the_request_does_not_fail_it(context: zmq.Context) -> None:
    """The peer restarted at the same address between two requests: the loss was before the
    second one was sent, so that one goes to the new server and is answered."""
    server = _serve(context)
    port = server.port
    client = SideChannelClient(context, "127.0.0.1", port, ME, timeout_s=5)
    try:
        assert client.request({"type": "echo", "value": 1})["echo"] == 1
        server.close()
        time.sleep(0.3)  # the loss (and refused reconnects) reported meanwhile
        server = SideChannelServer(context, "127.0.0.1", port, {"echo": _echo}, lambda: ME)
        time.sleep(0.3)  # reconnected
        assert client.request({"type": "echo", "value": 2})["echo"] == 2
    finally:
        client.close()
        server.close()


def test_hostile_frames_are_answered_and_server_keeps_serving(context: zmq.Context) -> None:
    server = _serve(context)
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    client = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=2)
    try:
        bad_frames = [
            [b"", b"\xc1\xff garbage"],
            [b"", msgpack.packb([1, 2, 3])],
            [b"", msgpack.packb({"type": "echo"})],  # no seq
            [b"", msgpack.packb({"seq": "x", "type": "echo"})],
        ]
        for frames in bad_frames:
            raw.send_multipart(frames)
            assert raw.poll(2000), "server did not answer a malformed frame"
            reply = msgpack.unpackb(raw.recv_multipart()[-1])
            assert reply["ok"] is False and reply["error"]
        raw.send_multipart([b"a", b"b", b"c", b"d"])  # wrong frame count: dropped
        assert client.request({"type": "echo", "value": "still"})["echo"] == "still"
    finally:
        raw.close(linger=0)
        client.close()
        server.close()


def test_auth_token_required(context: zmq.Context) -> None:
    server = _serve(context, token=TOKEN)
    good = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=2, auth_token=TOKEN)
    bad = SideChannelClient(
        context, "127.0.0.1", server.port, ME, timeout_s=2, auth_token=WRONG_TOKEN
    )
    none = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=2)
    try:
        assert good.request({"type": "echo", "value": 1})["echo"] == 1
        for client in (bad, none):
            with pytest.raises(SideChannelError, match="authentication failed"):
                client.request({"type": "echo", "value": 1})
    finally:
        for client in (good, bad, none):
            client.close()
        server.close()


def test_bind_failure_names_the_address(context: zmq.Context) -> None:
    server = _serve(context)
    try:
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{server.port}"):
            SideChannelServer(context, "127.0.0.1", server.port, {}, lambda: ME)
    finally:
        server.close()


def test_a_failing_message_does_not_end_the_channel(
    context: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = _serve(context)
    client = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=0.5)
    calls = {"n": 0}
    answer = server._answer

    def fail_once(frame: bytes) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected outside the handler guard")
        return answer(frame)

    monkeypatch.setattr(server, "_answer", fail_once)
    try:
        with pytest.raises(SideChannelError, match="no reply"):
            client.request({"type": "echo", "value": 1})
        assert server.serving
        assert client.request({"type": "echo", "value": 2})["echo"] == 2
    finally:
        client.close()
        server.close()


def test_a_dead_serving_thread_is_reported_and_shutdown_stays_bounded(
    context: zmq.Context, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = _serve(context)
    client = SideChannelClient(context, "127.0.0.1", server.port, ME, timeout_s=0.5)

    def die(frame: bytes) -> dict[str, Any]:
        raise SystemExit("injected: the serving thread ends")

    monkeypatch.setattr(server, "_answer", die)
    try:
        with pytest.raises(SideChannelError, match="no reply"):
            client.request({"type": "echo", "value": 1})
        server._thread.join(timeout=2)
        assert not server.serving
        assert "stopped serving" in caplog.text and "no decode engine can link" in caplog.text
    finally:
        client.close()
        start = time.monotonic()
        server.close()
        server.close()  # idempotent
        assert time.monotonic() - start < 1.0
    # The context fixture's term() returns: every socket was closed although the thread died.


def _signed(body: dict[str, Any], **changes: Any) -> bytes:
    """``body`` as a client for ``ME`` sends it, with ``changes`` signed over it."""
    body = {**body, "wire": 2, "to": ME.to_wire(), **changes}
    body["auth"] = signature(TOKEN, body)
    return msgpack.packb(body, use_bin_type=True)


def test_a_captured_signed_request_is_not_accepted_twice(context: zmq.Context) -> None:
    served: list[int] = []

    def count(message: dict[str, Any]) -> dict[str, Any]:
        served.append(message["value"])
        return {}

    server = SideChannelServer(context, "127.0.0.1", 0, {"heartbeat": count}, lambda: ME, TOKEN)
    body = {"type": "heartbeat", "value": 1, "seq": 1, "nonce": b"n" * 16}
    try:
        captured = _signed(body, sent_at=time.time())
        assert raw_request(context, server.port, captured)["ok"]
        replay = raw_request(context, server.port, captured)
        assert not replay["ok"] and "replayed request" in replay["error"]
        old = raw_request(context, server.port, _signed(body, nonce=b"m" * 16, sent_at=1.0))
        assert not old["ok"] and "s off this host's clock" in old["error"]
        unsigned_time = raw_request(context, server.port, _signed(body, nonce=b"k" * 16))
        assert not unsigned_time["ok"] and "missing send time" in unsigned_time["error"]
        assert served == [1]
    finally:
        server.close()


def test_a_reply_not_signed_for_this_request_is_refused(context: zmq.Context) -> None:
    """A peer without the token (or a replayed old reply) cannot answer for the server, and
    one speaking an older wire version is named as such."""
    fake = context.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    client = SideChannelClient(context, "127.0.0.1", port, ME, timeout_s=2, auth_token=TOKEN)

    def answer(reply: dict[str, Any]) -> None:
        frames = fake.recv_multipart()
        request = msgpack.unpackb(frames[-1], raw=False)
        body = {"seq": request["seq"], "wire": 2, **reply}
        fake.send_multipart([frames[0], b"", msgpack.packb(body)])

    held = {"ok": True, "results": ["held"]}
    try:
        for reply, error in (
            (held, "unauthenticated reply"),  # unsigned
            ({**held, "auth": b"x" * 32}, "unauthenticated reply"),  # forged
            # signed with the token, but for another request's nonce
            ({**held, "auth": signature(TOKEN, {**held, "wire": 2}, b"o" * 16)}, "unauth"),
            ({**held, "wire": None}, "speaks side-channel wire version None, this engine 2"),
        ):
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.request, {"type": "done", "items": []})
                answer(reply)
                with pytest.raises(SideChannelError, match=error):
                    pending.result(timeout=5)
    finally:
        client.close()
        fake.close(linger=0)


@pytest.mark.parametrize(
    "host",
    [
        pytest.param(
            "::1",
            marks=pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
        "localhost",
    ],
)
def test_ipv6_and_host_names_serve_and_connect(context: zmq.Context, host: str) -> None:
    server = SideChannelServer(context, host, 0, {"echo": _echo}, lambda: ME, TOKEN)
    client = SideChannelClient(context, host, server.port, ME, timeout_s=2, auth_token=TOKEN)
    try:
        assert client.request({"type": "echo", "value": host})["echo"] == host
    finally:
        client.close()
        server.close()


def test_unbindable_host_names_the_keys(context: zmq.Context) -> None:
    with pytest.raises(
        RuntimeError, match="cannot bind no-such-host.invalid:0.*'side_channel_host'"
    ):
        SideChannelServer(context, "no-such-host.invalid", 0, {"echo": _echo}, lambda: ME)


@pytest.mark.parametrize("token", ["", TOKEN])
def test_a_request_for_another_rank_or_incarnation_is_refused(
    context: zmq.Context, token: str
) -> None:
    """Two ranks of one P share the token: a request captured on its way to rank 0 is
    refused by rank 1, and one for P's last start by the P running now; so are requests of
    an older wire version, and every request while P has no incarnation yet."""
    served: list[Destination] = []
    rank_one = Destination(ME.engine_id, 1, ME.incarnation)
    identities = {0: ME, 1: rank_one}

    def server(rank: int) -> SideChannelServer:
        def note(message: dict[str, Any]) -> dict[str, Any]:
            served.append(identities[rank])
            return {}

        return SideChannelServer(
            context, "127.0.0.1", 0, {"heartbeat": note}, lambda: identities[rank], token
        )

    servers = [server(0), server(1)]
    heartbeat = {"type": "heartbeat", "items": []}
    try:
        captured = msgpack.packb(seal_request(heartbeat, 1, ME, token, time.time())[0])
        assert raw_request(context, servers[0].port, captured)["ok"]
        replay = raw_request(context, servers[1].port, captured)
        assert not replay["ok"]
        assert "is for engine p rank 0 incarnation a1, this is engine p rank 1" in replay["error"]
        restarted = Destination(ME.engine_id, 0, 0xB2)
        stale = msgpack.packb(seal_request(heartbeat, 2, restarted, token, time.time())[0])
        refused = raw_request(context, servers[0].port, stale)["error"]
        assert "is for engine p rank 0 incarnation b2, this is engine p rank 0 incarnation a1" in (
            refused
        )
        old_wire = msgpack.unpackb(captured, raw=False)
        del old_wire["wire"]
        old = raw_request(context, servers[0].port, msgpack.packb(old_wire))["error"]
        assert "wire version 1, this engine speaks 2" in old
        identities[1] = Destination(ME.engine_id, 1, 0)  # its scheduler has not written it
        client = SideChannelClient(
            context, "127.0.0.1", servers[1].port, rank_one, 2.0, auth_token=token
        )
        with pytest.raises(SideChannelError, match="still starting"):
            client.request(heartbeat)
        client.close()
        assert served == [ME]
    finally:
        for each in servers:
            each.close()


def test_first_contact_handshake_names_no_incarnation(context: zmq.Context) -> None:
    """A push-mode D knows P by an engine id (maybe of P's previous start) and an address
    only: a handshake for this rank naming incarnation 0 is answered (it reveals what P's
    params would), anything else still is not."""
    answered: list[str] = []

    def note(kind: str) -> Any:
        def handler(message: dict[str, Any]) -> dict[str, Any]:
            answered.append(kind)
            return {}

        return handler

    handlers = {"handshake": note("handshake"), "heartbeat": note("heartbeat")}
    server = SideChannelServer(context, "127.0.0.1", 0, handlers, lambda: ME)
    unknown = Destination(ME.engine_id, 0, 0)
    try:
        client = SideChannelClient(context, "127.0.0.1", server.port, unknown, 2.0)
        client.request({"type": "handshake", "schema": 4})
        with pytest.raises(SideChannelError, match="is for engine p rank 0 incarnation 0"):
            client.request({"type": "heartbeat", "items": []})
        client.close()
        renamed = Destination("p-before-its-restart", 0, 0)
        client = SideChannelClient(context, "127.0.0.1", server.port, renamed, 2.0)
        client.request({"type": "handshake", "schema": 4})
        client.close()
        other_rank = Destination(ME.engine_id, 1, 0)
        client = SideChannelClient(context, "127.0.0.1", server.port, other_rank, 2.0)
        with pytest.raises(SideChannelError, match="rank 1"):
            client.request({"type": "handshake", "schema": 4})
        client.close()
        assert answered == ["handshake", "handshake"]
    finally:
        server.close()
