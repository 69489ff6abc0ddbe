"""The side channel: a ZMQ ROUTER server and DEALER clients exchanging msgpack maps.

It carries the handshake (P's layout and engine address), "done"/"release" notifications
and lease heartbeats. Nothing received is trusted: frames are size-capped by ZMQ, decoded
with msgpack limits, type-checked, and answered with {"ok": False, "error": ...} when bad.
With an auth token, every request carries an HMAC-SHA256 of its body; the server refuses
any request without a valid one before running a handler.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
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


def _signature(token: str, body: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in body.items() if k != "auth"}
    canonical = msgpack.packb(sorted(unsigned.items()), use_bin_type=True)
    return hmac.new(token.encode(), canonical, hashlib.sha256).digest()


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
            raise RuntimeError(f"side channel cannot bind {host}:{port}: {e}") from e
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
                "handshakes or lease checks, so every pull from it fails until it restarts",
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


class SideChannelClient:
    """Request/reply to one peer's side channel; thread-safe, every call bounded."""

    def __init__(
        self, context: zmq.Context, host: str, port: int, timeout_s: float, auth_token: str = ""
    ) -> None:
        self._context = context
        self._endpoint = endpoint(host, port)
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._auth_token = auth_token
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            seq = next(self._seq)
            body = {**message, "seq": seq}
            if self._auth_token:
                body["auth"] = _signature(self._auth_token, body)
            sock = self._connected()
            sock.send_multipart([b"", _pack(body)])
            while True:
                if not sock.poll(self._timeout_ms, zmq.POLLIN):
                    self._reset()  # a late reply must not be taken for the next request's
                    raise SideChannelError(
                        f"no reply from {self._endpoint} to {message.get('type')!r} "
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
            if not reply.get("ok"):
                raise SideChannelError(f"{self._endpoint} refused: {reply.get('error')}")
            return reply

    def close(self) -> None:
        with self._lock:
            self._reset()

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
