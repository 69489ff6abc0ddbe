"""Many decode-side LLMDataDist instances, one per process, for the fan-in test: this process
imports everything once and forks a child per decoder (cheap: the children share its pages),
so hundreds of real processes start in seconds on a small host.

Run: python fan_in_decoders.py --count N --peer-port P --peer-cluster C [--auth-token T]
It prints {"pids": [...]} once every child is waiting. Then, on stdin:
- "go": every child at once inits its LLMDataDist, links the peer, pulls its blocks and checks
  every byte; one line {"linked": n, "verified": n, "errors": [...]} once all reported;
- "unlink": every child unlinks, finalizes and exits; {"exited": n};
- "kill": every child is SIGKILLed without unlinking; {"killed": n}.
A child's report is one line on a pipe shared by all (each line shorter than PIPE_BUF, so
lines never interleave).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from datadist_peer import (  # noqa: E402
    BLOCK_BYTES,
    BLOCK_SHAPE,
    NUM_BLOCKS,
    NUM_TENSORS,
    SEED,
    tensor_bytes,
)

from hixl_connector.datadist import load_backend  # noqa: E402

BLOCKS_PER_PULL = 4
CLUSTER_BASE = 60000
REPORT_TIMEOUT_S = 120.0


def decoder(index: int, args: argparse.Namespace, commands: int, reports: int) -> None:
    """One child: waits for "go", links, pulls and verifies, reports, then waits for "unlink"."""
    inbox = os.fdopen(commands, "r")
    outbox = os.fdopen(reports, "w", buffering=1)

    def report(**fields: Any) -> None:
        outbox.write(json.dumps({"index": index, **fields}) + "\n")

    inbox.readline()  # "go"
    try:
        dd, info = link_pull_and_check(index, args, report)
    except Exception as exc:  # reported to the test, which fails on it
        report(linked=False, error=f"{type(exc).__name__}: {exc}"[:200])
        inbox.readline()
        os._exit(1)
    inbox.readline()  # "unlink"
    dd.unlink_clusters([info], 5000)
    dd.finalize()
    os._exit(0)


def link_pull_and_check(index: int, args: argparse.Namespace, report: Any) -> tuple[Any, Any]:
    api = load_backend("native")
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.hixl_transport = "tcp"
    config.hixl_tcp_connections = 2
    config.sync_kv_timeout = 60_000
    if args.auth_token:
        config.hixl_auth_token = args.auth_token
    dd = api.LLMDataDist(api.LLMRole.DECODER, CLUSTER_BASE + index)
    dd.init(config.generate_options())
    tensors = [np.zeros(BLOCKS_PER_PULL * BLOCK_BYTES, np.uint8) for _ in range(NUM_TENSORS)]
    desc = api.CacheDesc(
        NUM_TENSORS, [BLOCKS_PER_PULL, *BLOCK_SHAPE], api.DataType.DT_BF16, api.Placement.HOST
    )
    cache = dd.cache_manager.register_blocks_cache(
        desc, [t.ctypes.data for t in tensors], remote_accessible=True
    )
    info = api.LLMClusterInfo()
    info.remote_cluster_id = args.peer_cluster
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", args.peer_port)
    _, results = dd.link_clusters([info], 60_000)
    if results[0] != api.LLMStatusCode.LLM_SUCCESS:
        report(linked=False, error=f"link: {results[0]!r}")
        return dd, info
    # Each decoder reads its own blocks of the peer's cache, and checks every byte.
    src = [(index * BLOCKS_PER_PULL + i) % NUM_BLOCKS for i in range(BLOCKS_PER_PULL)]
    dd.cache_manager.pull_blocks(
        api.BlocksCacheKey(args.peer_cluster, 0), cache, src, list(range(BLOCKS_PER_PULL))
    )
    wrong = [
        (t, block)
        for t, tensor in enumerate(tensors)
        for i, block in enumerate(src)
        if not np.array_equal(
            tensor[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES],
            tensor_bytes(SEED, "kv", t, NUM_BLOCKS * BLOCK_BYTES)[
                block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES
            ],
        )
    ]
    report(linked=True, verified=not wrong, error=f"wrong bytes in {wrong[:3]}" if wrong else "")
    return dd, info


def read_reports(fd: int, count: int) -> list[dict[str, Any]]:
    """Each child's report, or as many as came within REPORT_TIMEOUT_S (raw reads: a buffered
    reader could hold lines select cannot see)."""
    lines: list[dict[str, Any]] = []
    pending = b""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    while len(lines) < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *whole, pending = pending.split(b"\n")
        lines += [json.loads(line) for line in whole if line]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--peer-port", type=int, required=True)
    parser.add_argument("--peer-cluster", type=int, required=True)
    parser.add_argument("--auth-token", default="")
    args = parser.parse_args()
    reports_r, reports_w = os.pipe()
    children: list[tuple[int, int]] = []  # (pid, its command pipe)
    for index in range(args.count):
        commands_r, commands_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(reports_r)
            os.close(commands_w)
            for _, other in children:
                os.close(other)
            try:
                decoder(index, args, commands_r, reports_w)
            finally:
                os._exit(1)
        os.close(commands_r)
        children.append((pid, commands_w))
    os.close(reports_w)
    print(json.dumps({"pids": [pid for pid, _ in children]}), flush=True)

    def tell(word: str) -> None:
        for _, pipe in children:
            os.write(pipe, (word + "\n").encode())

    for line in sys.stdin:
        command = line.strip()
        if command == "go":
            tell("go")
            lines = read_reports(reports_r, len(children))
            errors = [f"{r['index']}: {r['error']}" for r in lines if r.get("error")]
            if len(lines) < len(children):
                errors.append(f"only {len(lines)} of {len(children)} reported")
            linked = sum(1 for r in lines if r["linked"])
            verified = sum(1 for r in lines if r.get("verified"))
            print(json.dumps({"linked": linked, "verified": verified, "errors": errors[:5]}))
        elif command == "unlink":
            tell("unlink")
            exited = sum(1 for pid, _ in children if os.waitpid(pid, 0)[1] == 0)
            print(json.dumps({"exited": exited}))
        elif command == "kill":
            for pid, _ in children:
                os.kill(pid, signal.SIGKILL)
            for pid, _ in children:
                os.waitpid(pid, 0)
            print(json.dumps({"killed": len(children)}))
        sys.stdout.flush()
        if command in ("unlink", "kill"):
            return


if __name__ == "__main__":
    main()
