"""The side channel: a ZMQ ROUTER server and DEALER clients exchanging msgpack maps.

It carries the handshake (P's layout and engine address), "done"/"release" notifications
and lease heartbeats. Nothing received is trusted: frames are size-capped by ZMQ, decoded
with msgpack limits, type-checked, and answered with {"ok": False, "error": ...} when bad.
What a message carries around its body (wire version, destination, nonce, send time, HMAC)
and the checks of it are in ``peers.envelope``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from hixl_connector.connector.peers.envelope import (
    MAX_MESSAGE_BYTES,
    Destination,
    RequestGate,
    pack,
    reply_problem,
    seal_reply,
    seal_request,
    unpack,
)

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelError(RuntimeError):
    """A side-channel request failed: timeout, refused, or a malformed reply."""


class SideChannelTimeout(SideChannelError):
    """No reply within the timeout: the peer is gone, stopped, or cut off."""


class SideChannelRefused(SideChannelTimeout):
    """The peer's host closed or refused the connection while a request waited for its
    reply (nothing listens there now): no reply can come, known without waiting out the
    timeout. A peer that is cut off or frozen refuses nothing, so it still times out."""


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Serves `handlers[message["type"]]` on one thread until `close()`, for requests that
    name ``identity()`` as their destination (read per request: P's incarnation is written
    after the server starts). ``clock`` is the wall clock send times are checked against."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        port: int,
        handlers: dict[str, Handler],
        identity: Callable[[], Destination],
        auth_token: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._handlers = handlers
        self._identity = identity
        self._auth_token = auth_token
        self._gate = RequestGate(auth_token)
        self._clock = clock
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                self.port = self._socket.bind_to_random_port(endpoint(host, 0).rsplit(":", 1)[0])
            else:
                self._socket.bind(endpoint(host, port))
                self.port = port
        except zmq.ZMQError as e:
            self._socket.close()
            raise RuntimeError(
                f"side channel cannot bind {host}:{port} (kv_connector_extra_config keys "
                f"'side_channel_host', 'side_channel_port'): {e}"
            ) from e
        self.host = host
        wake_address = f"inproc://hixl-side-channel-stop-{id(self)}"
        self._wake_rx = context.socket(zmq.PAIR)
        self._wake_rx.bind(wake_address)
        self._wake_tx = context.socket(zmq.PAIR)
        self._wake_tx.connect(wake_address)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="hixl-side-channel", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        """False once the serving thread has ended (closed, or died: see the error log)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stops serving and closes the sockets, within a bounded time, even if the serving
        thread died (a socket left open would hang ``zmq.Context.term()`` forever)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            try:
                self._wake_tx.send(b"stop", zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("side channel: stop signal not sent: %s", e)
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                logger.error("side channel: serving thread did not stop within 5 s")
        for sock in (self._wake_tx, self._wake_rx, self._socket):
            sock.close(linger=0)

    def _serve(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            poller.register(self._wake_rx, zmq.POLLIN)
            while True:
                events = dict(poller.poll())
                if self._wake_rx in events:
                    return
                try:
                    self._serve_one()
                except Exception:  # one bad message or reply must not end the channel
                    logger.exception("side channel %s:%d: a message failed", self.host, self.port)
        except BaseException as e:
            logger.critical(
                "side channel %s:%d stopped serving (%r): this prefill engine no longer answers "
                "handshakes or lease notices, so no decode engine can link to it and its leases "
                "end only by expiry, until it restarts",
                self.host,
                self.port,
                e,
            )

    def _serve_one(self) -> None:
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("side channel: dropped a message with %d frames", len(frames))
            return
        reply, request_nonce = self._answer(frames[2])
        try:
            sealed = seal_reply(reply, self._auth_token, request_nonce)
            self._socket.send_multipart([frames[0], b"", pack(sealed)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("side channel: reply not sent: %s", e)

    def _answer(self, frame: bytes) -> tuple[dict[str, Any], bytes]:
        """The reply, and the nonce of the request it answers (signed with it)."""
        try:
            message = unpack(frame)
        except Exception as e:  # hostile or corrupt bytes: any decoder error
            logger.warning("side channel: undecodable message (%d bytes): %s", len(frame), e)
            return {"ok": False, "error": f"undecodable message: {e}"}, b""
        seq = message.get("seq")
        if not isinstance(seq, int):
            return {"ok": False, "error": "missing integer 'seq'"}, b""
        refusal = self._gate.refusal(message, self._identity(), self._clock())
        if refusal:
            logger.warning("side channel: refused a %r request: %s", message.get("type"), refusal)
            return {"ok": False, "seq": seq, "error": refusal}, b""
        nonce = message.get("nonce") if self._auth_token else b""
        assert isinstance(nonce, bytes)  # the gate admits no signed request without one
        return self._dispatch(message, seq), nonce

    def _dispatch(self, message: dict[str, Any], seq: int) -> dict[str, Any]:
        handler = self._handlers.get(message.get("type"))  # type: ignore[arg-type]
        if handler is None:
            return {"ok": False, "seq": seq, "error": f"unknown type {message.get('type')!r}"}
        try:
            reply = handler(message)
        except (KeyError, TypeError, ValueError) as e:
            return {"ok": False, "seq": seq, "error": f"bad {message.get('type')}: {e}"}
        except Exception as e:  # a handler bug must not kill the channel
            logger.exception("side channel: handler %r failed", message.get("type"))
            return {"ok": False, "seq": seq, "error": f"internal error: {e}"}
        return {"ok": True, "seq": seq, **reply}


# How often a request waiting for its reply checks whether its owner shuts down.
STOP_POLL_MS = 50
# What the connection reports when the peer's host ended it or refused a new one.
LOST_CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class SideChannelClient:
    """Request/reply to the side channel of the prefill rank ``to``, which refuses requests
    for any other; thread-safe, every call bounded."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        port: int,
        to: Destination,
        timeout_s: float,
        auth_token: str = "",
        stop: threading.Event | None = None,
    ) -> None:
        self._context = context
        self._to = to
        # Set when the owner shuts down: a request waiting for its reply gives up at once.
        self._stop = stop or threading.Event()
        self._endpoint = endpoint(host, port)
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._auth_token = auth_token
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # the socket's LOST_CONNECTION_EVENTS
        # Closed for good: a request after close raises (a socket made then would belong to
        # no one, and zmq.Context.term would wait for it forever).
        self._closed = False

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise SideChannelError(
                    f"the client of {self._endpoint} is closed; {message.get('type')!r} not sent"
                )
            seq = next(self._seq)
            body, nonce = seal_request(message, seq, self._to, self._auth_token, time.time())
            sock = self._connected()
            self._forget_lost_connections()  # only a loss after the send dooms this request
            sock.send_multipart([b"", pack(body)])
            while True:
                outcome = self._poll(sock)
                if outcome != "reply":
                    self._reset()  # a late reply must not be taken for the next request's
                    raise self._no_reply(outcome, message.get("type"))
                frames = sock.recv_multipart()
                try:
                    reply = unpack(frames[-1])
                except Exception as e:
                    self._reset()
                    raise SideChannelError(f"malformed reply from {self._endpoint}: {e}") from e
                if reply.get("seq") in (seq, None):
                    break
            problem = reply_problem(reply, self._auth_token, nonce)
            if problem:
                self._reset()
                # A refusal is never taken as an answer, so its unverified text is shown.
                what = f": {reply.get('error')}" if not reply.get("ok") else ""
                raise SideChannelError(
                    f"{problem} from {self._endpoint} to {message.get('type')!r}{what}"
                )
            if not reply.get("ok"):
                raise SideChannelError(f"{self._endpoint} refused: {reply.get('error')}")
            return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()

    def _poll(self, sock: zmq.Socket) -> str:
        """Waits for a reply up to the timeout, in slices so that ``stop`` ends the wait:
        "reply", "timeout", "stopping", or "refused" once the connection was lost."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return "timeout"
            ready = dict(poller.poll(min(left_ms, STOP_POLL_MS)))
            if sock in ready:
                return "reply"
            if self._monitor is not None and self._monitor in ready:
                return "refused"
        return "stopping"

    def _no_reply(self, outcome: str, kind: Any) -> SideChannelError:
        if outcome == "refused":
            return SideChannelRefused(
                f"{self._endpoint} closed or refused the connection while {kind!r} waited for "
                "its reply: nothing listens there now"
            )
        if outcome == "stopping":
            return SideChannelError(
                f"shutting down: {kind!r} to {self._endpoint} abandoned before its reply"
            )
        return SideChannelTimeout(
            f"no reply from {self._endpoint} to {kind!r} within {self._timeout_ms} ms"
        )

    def _forget_lost_connections(self) -> None:
        """Drops the losses reported before now: the connection may be back since."""
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            recv_monitor_message(self._monitor)

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if self._endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            self._monitor = sock.get_monitor_socket(LOST_CONNECTION_EVENTS)
            sock.connect(self._endpoint)
            self._socket = sock
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(linger=0)
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
