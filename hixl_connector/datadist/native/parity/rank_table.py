"""Rank-table links (``LLMDataDist.link`` / ``unlink`` / ``query_register_mem_status``) on the
native engine.

CANN builds an HCCL communicator from the rank table and exchanges memory in the background;
every member can then pull from every other one. Here every member listens on its server's
``host_ip`` (the engine moves host memory, so the host NIC) at ``HCCL_IF_BASE_PORT + rank``
(60000 + rank by default), and links to every other member there, in the background, trying
until the others listen or ``LINK_TIMEOUT_S`` passes. The comm's status is PREPARING until
every link is up, then OK, or FAILED.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from hixl_connector.datadist.api.llm_types import RegisterMemStatus
from hixl_connector.datadist.api.status import LLMException, LLMStatusCode, raise_if_false

BASE_PORT_ENV = "HCCL_IF_BASE_PORT"
DEFAULT_BASE_PORT = 60000
LINK_TIMEOUT_S = 30.0
RETRY_S = 0.1


def base_port() -> int:
    raw = os.environ.get(BASE_PORT_ENV, str(DEFAULT_BASE_PORT))
    raise_if_false(raw.isdigit() and 0 < int(raw) < 65535, f"{BASE_PORT_ENV}={raw!r} is not a port")
    return int(raw)


def rank_hosts(rank_table: str) -> dict[int, str]:
    """{rank: host_ip of its server} from a rank table of version 1.0 or 1.2."""
    try:
        table = json.loads(rank_table)
        hosts = {
            int(device["rank_id"]): str(server["host_ip"])
            for server in table["server_list"]
            for device in server["device"]
        }
    except (ValueError, KeyError, TypeError) as exc:
        raise LLMException(
            f"rank_table: every server of server_list needs host_ip and devices with rank_id "
            f"({exc!r})",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from exc
    return hosts


class Comm:
    """One ``link()`` call's links: to every other member of the rank table."""

    def __init__(self, engine: Any, peers: dict[int, tuple[str, int]]) -> None:
        self._engine = engine
        self._peers = peers  # cluster id -> (host, port)
        self._linked: list[int] = []
        self._status = RegisterMemStatus.PREPARING
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._link_all, name="hixl-rank-link", daemon=True)
        self._thread.start()

    def _link_all(self) -> None:
        deadline = time.monotonic() + LINK_TIMEOUT_S
        waiting = dict(self._peers)
        while waiting and not self._stop.is_set() and time.monotonic() < deadline:
            for cluster, (host, port) in list(waiting.items()):
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                status, _ = self._engine.link(cluster, host, port, min(left_ms, 3000))
                if status == 0:
                    with self._lock:
                        self._linked.append(cluster)
                    del waiting[cluster]
            if waiting:
                self._stop.wait(RETRY_S)
        with self._lock:
            self._status = RegisterMemStatus.FAILED if waiting else RegisterMemStatus.OK

    def status(self) -> RegisterMemStatus:
        with self._lock:
            return self._status

    def unlink(self) -> None:
        """Local only, as in CANN: waits for the background links, then drops them."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            linked, self._linked = self._linked, []
        for cluster in linked:
            self._engine.unlink(cluster, 1000, True)
