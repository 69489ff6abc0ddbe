"""A serving peer for the native engine tests: real memory, real listener, own process.

Run as a script: allocates tensors with numpy, fills them with a known pattern, registers
them, listens on 127.0.0.1 port 0, prints one JSON line (port, pid, tensor addresses) and
serves until stdin closes. Commands on stdin, each answered with one JSON line:
"stats" (the engine's stats); "drop" (unregister the blocks cache, overwrite its memory with
SCRIBBLE bytes as a new owner would, and free it); "drop ID" (unregister cache ID); "swap TAG"
(drop, then register the blocks cache again on new memory filled with pattern tag TAG); "add"
(register a second blocks cache, EXTRA_CACHE_ID with model EXTRA_MODEL_ID); "grant WRITER
B,B,..." (grant those blocks of GRANTED_CACHE_ID, a blocks cache with model GRANTED_MODEL_ID
written by grant only, to cluster WRITER: [status, message, grant id]); "revoke GRANT MS"
(revoke_writes: [status, message]); "landed" (writes_landed: how many peers' writes landed).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

BLOCKS_CACHE_ID = 1
CONTIGUOUS_CACHE_ID = 2
PRIVATE_CACHE_ID = 3
EXTRA_CACHE_ID = 4
GRANTED_CACHE_ID = 5
MODEL_ID = 7
EXTRA_MODEL_ID = 9
GRANTED_MODEL_ID = 11
SCRIBBLE = 0x5A
# (req_id, prefix_id, model_id) of each batch row of the contiguous cache: key i <-> row i.
CONTIGUOUS_KEYS = [(5, -1, 7), (6, -1, 7)]


def pattern(cluster_id: int, cache_id: int, tensor: int, nbytes: int) -> np.ndarray:
    """Every 8-byte word names its cluster, cache, tensor and position."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    tag = (cluster_id << 56) | (cache_id << 48) | (tensor << 40)
    return (words | np.uint64(tag)).view(np.uint8)


def _tensors(cluster_id: int, cache_id: int, count: int, nbytes: int) -> list[np.ndarray]:
    return [pattern(cluster_id, cache_id, t, nbytes).copy() for t in range(count)]


def _block_list(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def _addrs(tensors: list[np.ndarray]) -> list[int]:
    return [int(t.ctypes.data) for t in tensors]


@dataclass
class NativePeer:
    """A running native_peer.py process."""

    cluster_id: int
    process: subprocess.Popen[str]
    info: dict[str, Any]

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def command(self, line: str, timeout_s: float = READY_TIMEOUT_S) -> Any:
        """Sends one command line and returns its JSON answer (bounded wait)."""
        proc = self.process
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        assert ready, f"peer did not answer {line!r}"
        return json.loads(proc.stdout.readline())

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.command("stats")
        return stats

    def stop(self) -> None:
        stop_peer_process(self.process)


@contextmanager
def stopped(pid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """Holds pid stopped (SIGSTOP) while the block runs and resumes it (SIGCONT) after, however
    the block ends, so that no test leaves a frozen peer behind."""
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_stopped(pid, timeout_s)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _wait_stopped(pid: int, timeout_s: float) -> None:
    """Until every thread of pid is really stopped (signal delivery is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [
            Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            for tid in os.listdir(f"/proc/{pid}/task")
        ]
        if all(state == "T" for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


def stop_peer_process(proc: subprocess.Popen[str]) -> None:
    """Ends a peer started with a stdin pipe: resume it, close stdin, wait, kill if it hangs."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)  # in case a test stopped it
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=STOP_TIMEOUT_S)
        except (subprocess.TimeoutExpired, OSError):
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:
                pass


def start_ready(
    cmd: list[str], what: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Any]:
    """Starts a peer process with stdin/stdout pipes and returns it with the JSON of its
    first stdout line, its ready signal (bounded wait; killed if it never comes)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        raise RuntimeError(f"{what} did not become ready within {READY_TIMEOUT_S}s")
    return proc, json.loads(line)


def start_peer(cluster_id: int, token: str = "", **geometry: int) -> NativePeer:
    """Starts a peer and waits (bounded) for its ready line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cluster-id", str(cluster_id)]
    if token:
        cmd += ["--token", token]
    for name, value in geometry.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    proc, info = start_ready(cmd, f"peer {cluster_id}")
    return NativePeer(cluster_id, proc, info)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster-id", type=int, required=True)
    parser.add_argument("--token", default="")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--row-bytes", type=int, default=65536)
    parser.add_argument("--server-handshakes", type=int, default=1024)
    parser.add_argument("--server-connections", type=int, default=4096)
    parser.add_argument("--server-threads", type=int, default=0)
    parser.add_argument("--transfer-threads", type=int, default=2)
    args = parser.parse_args()

    sys.path.insert(0, str(REPO_ROOT))
    from hixl_connector import _native

    engine = _native.Engine(
        args.cluster_id,
        listen_host="127.0.0.1",
        listen_port=0,
        auth_token=args.token,
        server_handshakes=args.server_handshakes,
        server_connections=args.server_connections,
        server_threads=args.server_threads,
        transfer_threads=args.transfer_threads,
    )
    blocks_bytes = args.blocks * args.block_bytes
    blocks = _tensors(args.cluster_id, BLOCKS_CACHE_ID, args.tensors, blocks_bytes)
    rows = _tensors(args.cluster_id, CONTIGUOUS_CACHE_ID, args.tensors, args.batch * args.row_bytes)
    private = _tensors(args.cluster_id, PRIVATE_CACHE_ID, 1, args.block_bytes)
    granted = _tensors(args.cluster_id, GRANTED_CACHE_ID, args.tensors, blocks_bytes)

    def register(cache_id: int, tensors: list[np.ndarray], count: int, *rest: Any) -> None:
        status, message = engine.register_cache(
            cache_id, _addrs(tensors), tensors[0].nbytes, count, *rest
        )
        if status != _native.SUCCESS:
            raise SystemExit(f"register_cache({cache_id}) failed: {status} {message}")

    register(BLOCKS_CACHE_ID, blocks, args.blocks, True, True, MODEL_ID, [])
    register(CONTIGUOUS_CACHE_ID, rows, args.batch, False, True, -1, CONTIGUOUS_KEYS)
    register(PRIVATE_CACHE_ID, private, 1, True, False, MODEL_ID + 1, [])
    status, message = engine.register_cache(
        GRANTED_CACHE_ID, _addrs(granted), blocks_bytes, args.blocks, True, True,
        GRANTED_MODEL_ID, [], writes_by_grant=True,
    )  # fmt: skip
    if status != _native.SUCCESS:
        raise SystemExit(f"register_cache({GRANTED_CACHE_ID}) failed: {status} {message}")
    info = {
        "port": engine.listen_port,
        "pid": os.getpid(),
        "blocks_addrs": _addrs(blocks),
        "blocks_tensor_bytes": blocks[0].nbytes,
        "private_addr": _addrs(private)[0],
        "granted_addrs": _addrs(granted),
    }
    print(json.dumps(info), flush=True)
    keep: list[np.ndarray] = []

    def drop() -> None:
        nonlocal blocks
        engine.unregister_cache(BLOCKS_CACHE_ID)
        for tensor in blocks:
            tensor.fill(SCRIBBLE)
        blocks = []  # the memory goes back to the allocator

    for line in sys.stdin:
        command, *arg = line.split()
        answer: Any = "ok"
        if command == "stats":
            answer = engine.stats()
        elif command == "drop" and arg:
            answer = engine.unregister_cache(int(arg[0]))
        elif command == "drop":
            drop()
        elif command == "swap":
            drop()
            blocks = _tensors(args.cluster_id, int(arg[0]), args.tensors, blocks_bytes)
            register(BLOCKS_CACHE_ID, blocks, args.blocks, True, True, MODEL_ID, [])
        elif command == "grant":
            answer = engine.grant_writes(int(arg[0]), GRANTED_CACHE_ID, _block_list(arg[1]))
        elif command == "revoke":
            answer = engine.revoke_writes(int(arg[0]), int(arg[1]))
        elif command == "landed":
            answer = engine.writes_landed()
        elif command == "add":
            keep = _tensors(args.cluster_id, EXTRA_CACHE_ID, args.tensors, args.block_bytes * 4)
            register(EXTRA_CACHE_ID, keep, 4, True, True, EXTRA_MODEL_ID, [])
        print(json.dumps(answer), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
