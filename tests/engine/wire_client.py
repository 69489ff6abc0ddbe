"""A raw client of the engine's wire protocol (native/README.md), for tests that play a
hostile or misbehaving peer against a real engine server."""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import time

HEADER = struct.Struct("<IHHQ")  # magic, version, frame type, payload length
MAGIC, VERSION = 0x4C584948, 4
HELLO, CHALLENGE, AUTH, WELCOME, TABLE_REQ, TABLE, READ, DATA = 1, 2, 3, 4, 5, 6, 7, 8
STALE, WRITE, WRITE_READY, WRITE_DONE, ERROR = 11, 12, 13, 14, 15
RETURN_PATH, RETURN_PATH_ACK = 16, 17
BYTES_FOLLOW, FROM_WRITER = 0, 1
CONTROL_CHANNEL, DATA_CHANNEL = 0, 1


def connect(port: int, rcvbuf: int = 0) -> socket.socket:
    """A TCP connection to 127.0.0.1:port with a 5 s timeout; `rcvbuf` fixes the receive
    buffer before connecting, so the advertised window stays that small."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    magic, version, kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert (magic, version) == (MAGIC, VERSION)
    return kind, recv_exact(sock, length)


def closed_within(socks: list[socket.socket], seconds: float) -> set[int]:
    """Indexes of the sockets the server closed (EOF or reset) within `seconds`."""
    closed: set[int] = set()
    deadline = time.monotonic() + seconds
    while len(closed) < len(socks) and (left := deadline - time.monotonic()) > 0:
        waiting = [s for i, s in enumerate(socks) if i not in closed]
        readable, _, _ = select.select(waiting, [], [], left)
        for s in readable:
            try:
                if s.recv(65536):
                    continue  # an ERROR frame before the close
            except ConnectionResetError:
                pass
            closed.add(socks.index(s))
    return closed


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes the connection (after at most one error frame)."""
    return closed_within([sock], within_s) == {0}


def send_hello(sock: socket.socket, cluster: int, channel: int = DATA_CHANNEL) -> bytes:
    """Sends HELLO as cluster 900 asking for `cluster`; returns the client nonce."""
    client_nonce = os.urandom(32)
    sock.sendall(frame(HELLO, struct.pack("<qqB", 900, cluster, channel) + client_nonce))
    return client_nonce


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The AUTH payload: an HMAC over both nonces, or 32 zero bytes without a token."""
    if not token:
        return bytes(32)
    message = b"hixl-client-v1" + server_nonce + client_nonce
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def handshake(
    sock: socket.socket, cluster: int, token: str = "", channel: int = DATA_CHANNEL
) -> None:
    """Completes HELLO/CHALLENGE/AUTH/WELCOME (as a data connection unless told)."""
    client_nonce = send_hello(sock, cluster, channel)
    kind, payload = recv_frame(sock)
    assert kind == CHALLENGE
    sock.sendall(frame(AUTH, client_proof(token, payload[1:33], client_nonce)))
    kind, _ = recv_frame(sock)
    assert kind == WELCOME


def welcomed(
    port: int, cluster: int, token: str = "", channel: int = DATA_CHANNEL
) -> socket.socket:
    """A connection to 127.0.0.1:port that completed the handshake as ``cluster``."""
    sock = connect(port)
    try:
        handshake(sock, cluster, token, channel)
    except BaseException:
        sock.close()
        raise
    return sock


def table_serials(sock: socket.socket) -> dict[int, int]:
    """Asks for the server's cache table; returns {cache id: registration serial}."""
    sock.sendall(frame(TABLE_REQ))
    kind, payload = recv_frame(sock)
    assert kind == TABLE
    (count,) = struct.unpack_from("<I", payload, 8)  # after the u64 generation
    offset, serials = 12, {}
    for _ in range(count):
        cache_id, serial = struct.unpack_from("<qQ", payload, offset)
        serials[cache_id] = serial
        offset += 16 + 1 + 8 + 8 + 8  # id, serial, is_blocks, tensor bytes, blocks, model
        (keys,) = struct.unpack_from("<I", payload, offset)
        offset += 4 + keys * 24
        (tensors,) = struct.unpack_from("<I", payload, offset)
        offset += 4 + tensors * 8
    return serials


def read_request(serial: int, *ranges: tuple[int, int]) -> bytes:
    """A READ of `ranges` planned against the registration with `serial`."""
    body = struct.pack("<QI", serial, len(ranges))
    return frame(READ, body + b"".join(struct.pack("<QQ", a, n) for a, n in ranges))


def write_request(
    serial: int, *ranges: tuple[int, int], source: int = BYTES_FOLLOW, grant: int = 0
) -> bytes:
    """A WRITE into `ranges` of the registration with `serial`, under write grant `grant`
    (0: none); with FROM_WRITER the caller appends the source addresses and the writer's
    proof to the returned frame's payload."""
    body = struct.pack("<QQBI", serial, grant, source, len(ranges))
    return body + b"".join(struct.pack("<QQ", a, n) for a, n in ranges)
