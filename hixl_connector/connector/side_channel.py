"""The side channel: a ZMQ ROUTER server and DEALER clients exchanging msgpack maps.

It carries the handshake (P's layout and engine address), "done"/"release" notifications
and lease heartbeats. Nothing received is trusted: frames are size-capped by ZMQ, decoded
with msgpack limits, type-checked, and answered with {"ok": False, "error": ...} when bad.
With an auth token, every request carries a fresh nonce, its send time and an HMAC-SHA256
of its body; the server refuses, before running a handler, a request without a valid one,
one sent more than ``REPLAY_WINDOW_S`` away from its own clock, or one whose nonce it has seen
(a replay). Every reply is signed over its body and the request's nonce, so a client takes
no reply that a peer without the token made up or that answers another request.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
# A signed request older or newer than this (by the server's wall clock) is refused, and its
# nonce is remembered this long: hosts' clocks must agree within it.
REPLAY_WINDOW_S = 30.0
MAX_REMEMBERED_NONCES = 1 << 16
NONCE_BYTES = 16
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelError(RuntimeError):
    """A side-channel request failed: timeout, refused, or a malformed reply."""


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(frame: bytes) -> dict[str, Any]:
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


def _signature(token: str, body: dict[str, Any], request_nonce: bytes = b"") -> bytes:
    """HMAC of a request (``request_nonce`` empty) or of a reply to the request that carried
    ``request_nonce``."""
    unsigned = {k: v for k, v in body.items() if k != "auth"}
    canonical = msgpack.packb([request_nonce, sorted(unsigned.items())], use_bin_type=True)
    return hmac.new(token.encode(), canonical, hashlib.sha256).digest()


class _Nonces:
    """The nonces of requests accepted within the replay window, oldest first (bounded)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def fresh(self, nonce: Any, sent_at: Any, now: float) -> str:
        """ "" when the request may be served, else why not; remembers an accepted nonce."""
        while self._seen and next(iter(self._seen.values())) < now - REPLAY_WINDOW_S:
            self._seen.popitem(last=False)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return "missing nonce"
        if isinstance(sent_at, bool) or not isinstance(sent_at, (int, float)):
            return "missing send time"
        if abs(now - sent_at) > REPLAY_WINDOW_S:
            return (
                f"sent {now - sent_at:.0f} s off this host's clock ({REPLAY_WINDOW_S:g} s allowed)"
            )
        if nonce in self._seen:
            return "replayed request"
        if len(self._seen) >= MAX_REMEMBERED_NONCES:
            return "too many requests within the replay window"
        self._seen[nonce] = now
        return ""


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Serves `handlers[message["type"]]` on one thread until `close()`."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        port: int,
        handlers: dict[str, Handler],
        auth_token: str = "",
    ) -> None:
        self._handlers = handlers
        self._auth_token = auth_token
        self._nonces = _Nonces()
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
        reply = self._answer(frames[2])
        if self._auth_token:
            reply["auth"] = _signature(self._auth_token, reply, reply.pop("nonce", b""))
        try:
            self._socket.send_multipart([frames[0], b"", _pack(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("side channel: reply not sent: %s", e)

    def _answer(self, frame: bytes) -> dict[str, Any]:
        try:
            message = _unpack(frame)
        except Exception as e:  # hostile or corrupt bytes: any decoder error
            logger.warning("side channel: undecodable message (%d bytes): %s", len(frame), e)
            return {"ok": False, "error": f"undecodable message: {e}"}
        seq = message.get("seq")
        if not isinstance(seq, int):
            return {"ok": False, "error": "missing integer 'seq'"}
        if self._auth_token:
            auth = message.get("auth")
            expected = _signature(self._auth_token, message)
            if not isinstance(auth, bytes) or not hmac.compare_digest(auth, expected):
                logger.warning("side channel: refused an unauthenticated request")
                return {"ok": False, "seq": seq, "error": "authentication failed"}
            nonce = message["nonce"] if isinstance(message.get("nonce"), bytes) else b""
            stale = self._nonces.fresh(nonce, message.get("sent_at"), time.time())
            if stale:
                logger.warning("side channel: refused a signed request: %s", stale)
                return {"ok": False, "seq": seq, "error": f"refused: {stale}"}
            return {**self._dispatch(message, seq), "nonce": nonce}
        return self._dispatch(message, seq)

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


class SideChannelClient:
    """Request/reply to one peer's side channel; thread-safe, every call bounded."""

    def __init__(
        self,
        context: zmq.Context,
        host: str,
        port: int,
        timeout_s: float,
        auth_token: str = "",
        stop: threading.Event | None = None,
    ) -> None:
        self._context = context
        # Set when the owner shuts down: a request waiting for its reply gives up at once.
        self._stop = stop or threading.Event()
        self._endpoint = endpoint(host, port)
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._auth_token = auth_token
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None
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
            body = {**message, "seq": seq}
            nonce = b""
            if self._auth_token:
                nonce = os.urandom(NONCE_BYTES)
                body.update(nonce=nonce, sent_at=time.time())
                body["auth"] = _signature(self._auth_token, body)
            sock = self._connected()
            sock.send_multipart([b"", _pack(body)])
            while True:
                if not self._poll(sock):
                    self._reset()  # a late reply must not be taken for the next request's
                    why = "shutting down" if self._stop.is_set() else "no reply"
                    raise SideChannelError(
                        f"{why} from {self._endpoint} to {message.get('type')!r} "
                        f"within {self._timeout_ms} ms"
                    )
                frames = sock.recv_multipart()
                try:
                    reply = _unpack(frames[-1])
                except Exception as e:
                    self._reset()
                    raise SideChannelError(f"malformed reply from {self._endpoint}: {e}") from e
                if reply.get("seq") in (seq, None):
                    break
            if self._auth_token and not self._authentic(reply, nonce):
                self._reset()
                # A refusal is never taken as an answer, so its unverified text is shown.
                what = f": {reply.get('error')}" if not reply.get("ok") else ""
                raise SideChannelError(
                    f"unauthenticated reply from {self._endpoint} to {message.get('type')!r}{what}"
                )
            if not reply.get("ok"):
                raise SideChannelError(f"{self._endpoint} refused: {reply.get('error')}")
            return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()

    def _poll(self, sock: zmq.Socket) -> bool:
        """Waits for a reply up to the timeout, in slices so that ``stop`` ends the wait."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        while not self._stop.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            if sock.poll(min(left_ms, STOP_POLL_MS), zmq.POLLIN):
                return True
        return False

    def _authentic(self, reply: dict[str, Any], nonce: bytes) -> bool:
        auth = reply.get("auth")
        expected = _signature(self._auth_token, reply, nonce)
        return isinstance(auth, bytes) and hmac.compare_digest(auth, expected)

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if self._endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(self._endpoint)
            self._socket = sock
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
