"""A member of a rank-table link for the tests: cluster 1, rank 0 of a two-rank table on
127.0.0.1 (HCCL_IF_BASE_PORT from the environment). Registers a blocks cache, links, then
allocates a keyed contiguous cache after the link (as CANN's samples do), prints one JSON
line and serves until stdin closes."""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engine import datadist_peer as layout  # noqa: E402

CLUSTER, OTHER = 1, 2
KEY_REQ_ID = 3


def rank_table() -> str:
    devices = [{"device_id": "0", "device_ip": "0.0.0.0", "rank_id": str(r)} for r in (0, 1)]
    server = {"device": devices, "host_ip": "127.0.0.1", "server_id": "1"}
    return json.dumps({"server_count": "1", "version": "1.2", "server_list": [server]})


def main() -> None:
    from hixl_connector import datadist as api

    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.mem_pool_cfg = json.dumps({"memory_size": 1 << 20})
    dd = api.LLMDataDist(api.LLMRole.PROMPT, CLUSTER)
    dd.init(config.generate_options())
    cm = dd.cache_manager
    kv = layout.make_tensors("kv", layout.NUM_TENSORS, layout.NUM_BLOCKS * layout.BLOCK_BYTES)
    desc = api.CacheDesc(
        layout.NUM_TENSORS, [layout.NUM_BLOCKS, *layout.BLOCK_SHAPE], api.DataType.DT_BF16
    )
    cm.register_blocks_cache(desc, [t.ctypes.data for t in kv], api.BlocksCacheKey(CLUSTER, 0))
    comm = dd.link("link", {CLUSTER: 0, OTHER: 1}, rank_table())
    while dd.query_register_mem_status(comm) == api.RegisterMemStatus.PREPARING:
        time.sleep(0.02)
    rows = api.CacheDesc(layout.NUM_TENSORS, [2, layout.CONTIG_ROW_BYTES], api.DataType.DT_UINT8)
    row = cm.allocate_cache(rows, [api.CacheKey(CLUSTER, KEY_REQ_ID)])
    contig = layout.make_tensors("contig", layout.NUM_TENSORS, 2 * layout.CONTIG_ROW_BYTES)
    for addr, tensor in zip(row.tensor_addrs, contig, strict=True):
        ctypes.memmove(addr, tensor.ctypes.data, tensor.nbytes)
    status = dd.query_register_mem_status(comm).name
    print(json.dumps({"status": status}), flush=True)
    sys.stdin.read()
    dd.unlink(comm)
    cm.deallocate_cache(row)
    dd.finalize()
    del kv


if __name__ == "__main__":
    main()
