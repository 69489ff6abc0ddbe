"""The prefill side of the ascend contract test: a real HixlWorker (kv_producer) in its own
process, on the "ascend" back-end over the llm_datadist STAND-IN, serving filled KV caches.

Run: python prefill_worker.py SPEC_FILE   (JSON: {"model_dir", "engine_id", "extra",
"tp_port", "leases": [[request_id, lease_id, [block ids]], ...], "state": a hybrid state
model's caches (optional)}).
Prints {"pid"} once registered and leasing; on EOF shuts down and prints the stand-in's
recorded calls as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the stand-in first, then the checkout


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import llm_datadist
    from worker_harness import P_INCARNATION, tp_group, worker_with_caches

    from hixl_connector.connector.leases.guarded_read import lease_word
    from hixl_connector.connector.metadata import HixlConnectorMetadata, SendSpec, WordSpec
    from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path
    from hixl_connector.tools.vllm_scheduler import vllm_config

    state = bool(spec.get("state"))
    config = vllm_config(
        Path(spec["model_dir"]),
        "kv_producer",
        engine_id=spec["engine_id"],
        extra=spec["extra"],
        state="none" if state else "",
    )
    with tp_group(config, spec["tp_port"]):
        worker, _ = worker_with_caches(config, spec["engine_id"], state, fill=True)
        # P's scheduler: its incarnation, then each lease's word for the workers to publish
        # (lease k takes slot k) and the lease itself.
        nonce = IncarnationFile.open(incarnation_path(spec["engine_id"], 0, 0))
        nonce.nonce = P_INCARNATION
        sends, words = [], []
        for slot, (request_id, lease, blocks) in enumerate(spec["leases"]):
            word = lease_word(lease, [blocks], P_INCARNATION)
            words.append(WordSpec(slot, word))
            sends.append(SendSpec(request_id, lease, slot, word))
        step = HixlConnectorMetadata(to_send=sends, to_publish=words)
        worker.bind(step)  # a step as vLLM runs it: words published, leases held
        worker.start_load_kv(step)
        print(json.dumps({"pid": os.getpid()}), flush=True)
        sys.stdin.read()
        worker.shutdown()
    print(json.dumps(llm_datadist.calls()), flush=True)


if __name__ == "__main__":
    main()
