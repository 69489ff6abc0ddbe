"""Requests that show a misconfigured deployment: counted by kind, and said once per kind with
the likely cause and what to change. Such a request is still served the way vLLM serves it
(computed locally, or failed by kv_load_failure_policy), but never silently: P/D that turned
into "prefill twice" must show in the metrics (``vllm:hixl_misconfigured_requests_total``,
labelled by kind) and in the log. Pure: no vLLM, no torch."""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger(__name__)

# kind -> what it means, with the likely cause and the key to change.
KINDS = {
    "consumer_asked_to_produce": (
        "asks this engine to prefill for a remote decode (do_remote_decode), but it is a "
        "kv_consumer: it answers without kv_transfer_params, so the decode side computes the "
        "whole prompt again. The router lists this decode server as a prefill server: fix "
        "the router's lists, or set kv_role to kv_producer (kv_both for both roles)"
    ),
    "producer_asked_to_consume": (
        "asks this engine to read a remote prefill (do_remote_prefill), but it is a "
        "kv_producer: it computes the whole prompt itself. The router lists this prefill "
        "server as a decode server: fix the router's lists, or set kv_role to kv_consumer "
        "(kv_both for both roles)"
    ),
    "decode_without_params": (
        "reached this decode engine (kv_consumer) without kv_transfer_params, so it computes "
        "the whole prompt itself: a router or gateway in front sends prompts straight to D or "
        "drops P's kv_transfer_params, which must reach D unchanged"
    ),
    "foreign_params": (
        "carries kv_transfer_params that another connector wrote (they lack {detail}), and "
        "fails: run HixlConnector on the prefill side too, the same version on both sides"
    ),
}


class Misconfigurations:
    """Counts of misconfigured requests by kind since the last ``take``; the first of each
    kind is logged as a warning, once per process."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._said: set[str] = set()

    def note(self, kind: str, request_id: str, detail: str = "") -> None:
        if kind not in KINDS:
            raise KeyError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
        self._counts[kind] += 1
        if kind not in self._said:
            self._said.add(kind)
            logger.warning(
                "hixl: request %s %s. Counted in vllm:hixl_misconfigured_requests_total"
                "{kind=%s}; said once.",
                request_id,
                KINDS[kind].format(detail=detail),
                kind,
            )

    def take(self) -> dict[str, int]:
        counts, self._counts = dict(self._counts), Counter()
        return counts
