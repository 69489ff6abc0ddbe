"""A prefill rank as D's PeerRegistry meets it, for the link-churn test: a real process whose
native engine serves the datadist peer's caches (datadist_peer.py) over TCP, with a side
channel answering the connector's handshake for them, until its stdin closes.

Run: python prefill_rank_peer.py --engine-id E --cluster-id N
It prints one JSON line {"side_channel_port", "pid"} once it is ready.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hixl_connector.connector.peers.handshake import (  # noqa: E402
    SCHEMA_VERSION,
    HandshakePayload,
    compatibility_hash,
)

# What D and P announce alike: whole blocks (no head split) of the datadist peer's cache.
FIELDS = {
    "model": "churn",
    "dtype": "bfloat16",
    "kv_layout": "cpu",
    "kv_split": "none",
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_size": 32,
    "unit_token_bytes": 128,
    "tensors_per_layer": 2,
    "num_tensors": 8,
}
BLOCK_TOKENS = 4


def announcement(engine_id: str, cluster_id: int, engine_port: int) -> HandshakePayload:
    return HandshakePayload(
        schema_version=SCHEMA_VERSION,
        compatibility_hash=compatibility_hash(FIELDS),
        compatibility=dict(FIELDS),
        engine_id=engine_id,
        tp_rank=0,
        tp_size=1,
        cluster_id=cluster_id,
        engine_host="127.0.0.1",
        engine_port=engine_port,
        num_blocks=64,
        units_per_block=1,
        block_sizes=[BLOCK_TOKENS],
        slice_bytes=0,
        state_parts=[],
        kv_parts=[],
        incarnation=0,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--cluster-id", type=int, required=True)
    args = parser.parse_args()
    import zmq
    from datadist_peer import _register

    from hixl_connector.connector.peers.envelope import Destination
    from hixl_connector.connector.peers.side_channel import SideChannelServer
    from hixl_connector.datadist import load_backend

    api = load_backend("native")
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.listen_ip_info = "127.0.0.1:0"
    config.hixl_transport = "tcp"
    dd = api.LLMDataDist(api.LLMRole.PROMPT, args.cluster_id)
    dd.init(config.generate_options())
    _, keep = _register(api, dd, args.cluster_id)
    answer = {"payload": announcement(args.engine_id, args.cluster_id, dd.listen_port).to_dict()}
    me = Destination(args.engine_id, 0, 0)
    context = zmq.Context()
    server = SideChannelServer(context, "127.0.0.1", 0, {"handshake": lambda _: answer}, lambda: me)
    print(json.dumps({"side_channel_port": server.port, "pid": os.getpid()}), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    server.close()
    context.term()
    dd.finalize()  # before the memory it serves is released
    del keep


if __name__ == "__main__":
    main()
