"""A prompt side the test process drives: listens with a blocks cache of the "kv" bytes
(datadist_peer.py), then follows one command per stdin line, answering each with one JSON
line:

- ``switch``: switch_role(DECODER), which closes the listener;
- ``link PORT CLUSTER``: link_clusters to 127.0.0.1:PORT (this side has no listener then);
- ``unlink CLUSTER``: unlink_clusters without force;
- ``push CLUSTER S,S,.. D,D,.. [GRANT]``: push_blocks of its blocks S into blocks D of that
  cluster's BlocksCacheKey(CLUSTER, 0) cache (a cluster linked here or linked to), under
  write grant GRANT (``hixl_write_grant``) when given;
- ``pushes N CLUSTER S,S,.. D,D,.. [GRANT]``: the same push from N threads at once (their
  statuses, in a list).

Run: python prompt_peer.py --cluster-id N --transport cma|tcp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engine import datadist_peer as layout  # noqa: E402


def at_once(push: Callable[[], Any], threads: int, failure: type[Exception]) -> list[str]:
    """``push`` from ``threads`` threads released together: each one's status name."""
    start = threading.Barrier(threads)

    def one(_: int) -> str:
        start.wait()
        try:
            push()
            return "LLM_SUCCESS"
        except failure as exc:
            return str(exc.status_code.name)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(threads)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster-id", type=int, required=True)
    parser.add_argument("--transport", required=True)
    args = parser.parse_args()
    from hixl_connector import datadist as api

    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.listen_ip_info = "127.0.0.1:0"
    config.hixl_transport = args.transport
    dd = api.LLMDataDist(api.LLMRole.PROMPT, args.cluster_id)
    dd.init(config.generate_options())
    kv = layout.make_tensors("kv", layout.NUM_TENSORS, layout.NUM_BLOCKS * layout.BLOCK_BYTES)
    desc = api.CacheDesc(
        layout.NUM_TENSORS, [layout.NUM_BLOCKS, *layout.BLOCK_SHAPE], api.DataType.DT_BF16
    )
    key = api.BlocksCacheKey(args.cluster_id, 0)
    cache = dd.cache_manager.register_blocks_cache(desc, [t.ctypes.data for t in kv], key)
    print(json.dumps({"port": dd.listen_port, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "switch":
            dd.switch_role(api.LLMRole.DECODER)
            print(json.dumps({"listen_port": dd.listen_port}), flush=True)
            continue
        if words[0] in ("push", "pushes"):
            threads = int(words.pop(1)) if words[0] == "pushes" else 1
            src, dst = ([int(b) for b in w.split(",")] for w in words[2:4])
            grant = {"hixl_write_grant": int(words[4])} if len(words) > 4 else {}
            target = api.BlocksCacheKey(int(words[1]), 0)
            push = partial(dd.cache_manager.push_blocks, target, cache, src, dst, **grant)
            statuses = at_once(push, threads, api.LLMException)
            answer = statuses if words[0] == "pushes" else statuses[0]
            print(json.dumps({"status": answer}), flush=True)
            continue
        cluster = api.LLMClusterInfo()
        cluster.remote_cluster_id = int(words[-1])
        cluster.append_local_ip_info("127.0.0.1", 0)
        if words[0] == "link":
            cluster.append_remote_ip_info("127.0.0.1", int(words[1]))
            status, _ = dd.link_clusters([cluster], 5000)
        else:
            status, _ = dd.unlink_clusters([cluster], 5000)
        print(json.dumps({"status": status.name}), flush=True)
    dd.finalize()  # before the memory it serves is released
    del kv


if __name__ == "__main__":
    main()
