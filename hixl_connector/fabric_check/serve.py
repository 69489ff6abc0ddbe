"""The prefill side of the fabric check: probe blocks registered as a P rank registers its
KV, the probe lease's word published, served until stdin closes."""

from __future__ import annotations

import json
import sys

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.fabric_check.probe import LEASE_SLOT, ProbeShape, probe_kv, register


def serve(config: HixlConfig, shape: ProbeShape, device: str) -> int:
    """Prints one JSON line once served ({"port", "placements"}), then serves until EOF on
    stdin; raises what bringing the engine up raised."""
    kv = probe_kv(shape, device, fill=True)
    registered, _ = register(config, kv, shape, prefill=True)
    try:
        assert registered.lease_word_memory is not None  # a producer's
        LeaseWords(registered.lease_word_memory).publish(LEASE_SLOT, shape.word())
        ready = {"port": registered.listen_port, "placements": registered.placements()}
        print(json.dumps(ready), flush=True)
        sys.stdin.read()
    finally:
        registered.datadist.finalize()  # before the probe memory it serves goes
        del kv
    return 0
