"""TEST ONLY: a side channel reached with raw frames, as a hostile or replaying peer reaches
it: no envelope and no checks, whatever bytes the test chooses."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq


class RawSideChannel:
    def __init__(
        self, context: zmq.Context, port: int, host: str = "127.0.0.1", timeout_ms: int = 5000
    ) -> None:
        self._timeout_ms = timeout_ms
        self._where = f"{host}:{port}"
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{self._where}")

    def ask(self, frame: bytes) -> Any:
        """Sends ``frame`` as one request; the unpacked reply (within the timeout)."""
        self._socket.send_multipart([b"", frame])
        assert self._socket.poll(self._timeout_ms), f"no reply from {self._where}"
        return msgpack.unpackb(self._socket.recv_multipart()[-1], raw=False)

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> RawSideChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_request(context: zmq.Context, port: int, frame: bytes) -> Any:
    """One raw request on a socket of its own."""
    with RawSideChannel(context, port) as raw:
        return raw.ask(frame)
