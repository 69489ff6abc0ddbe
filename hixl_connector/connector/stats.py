"""Transfer statistics: vLLM's KVConnectorStats (the periodic log line) and Prometheus.

Workers record observations; vLLM ships `data` to the logger process, which rebuilds the
object through `HixlConnector.build_kv_connector_stats` and aggregates across workers.
`data` holds only lists of numbers so that it serialises anywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_SERIES = ("pull_seconds", "kv_ready_seconds", "pull_bytes", "pull_blocks")
_COUNTS = (
    "failed_pulls",
    "failed_handshakes",
    "failed_notifications",
    "expired_leases",
    "refused_pulls",  # P would not vouch for the blocks before the read
    "stale_pulls",  # the lease ended during the read: the data was thrown away
    "invalid_requests",  # kv_transfer_params D cannot pull by (refused before any I/O)
    "cancelled_pulls",  # the request was aborted before its read ended: nothing read is used
    "sync_loads",  # reads that landed before the forward of the step that needed them
    # Small enough for the step, but over the network: loaded asynchronously, so that no
    # step waits on a peer.
    "network_reads_async",
    # A synchronous read found no same-host link to its P (restarted or gone): invalid blocks.
    "sync_load_peer_gone",
    # A prefill rank at a known address answered with a new incarnation (P restarted): its
    # old link was dropped.
    "peer_restarts",
    # Links to prefill ranks no read used for link_idle_s, unlinked (the next read links).
    "idle_unlinks",
    # Push mode. P: requests it wrote into D, or failed to; D: requests P wrote here (also
    # counted as pulls, with their blocks and bytes), failed, or given up on after
    # push_timeout_s.
    "pushes",
    "failed_pushes",
    "early_push_registrations",  # P: D registered before P's prefill finished (concurrent)
    "layered_pushes",  # P: pushes whose first layers were written while P computed them
    "push_registrations",  # D: requests whose blocks P accepted to write
    "push_receives",
    "failed_push_receives",
    "push_timeouts",
    # D: pushes failed because P said it gave up on them (asked every PUSH_CHECK_S), and
    # because their P rank stopped answering or restarted (failed together, at once).
    "push_failures_heard",
    "push_peers_lost",
)
# Counters an earlier release exported under another name: each old name is still exported
# (vllm:hixl_<old>_total, counting what the new one counts) for at least one release after
# the rename; CHANGELOG.md lists each.
RENAMED_COUNTERS = {"in_step_loads": "sync_loads", "in_step_peer_gone": "sync_load_peer_gone"}
# Requests that show a misconfigured deployment, by kind (misconfig.KINDS): data keys
# "misconfigured_requests:<kind>", one Prometheus counter labelled by kind.
MISCONFIGURED = "misconfigured_requests"


@dataclass
class HixlKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[float]] = {name: [] for name in (*_SERIES, *_COUNTS)}

    def record_pull(
        self, seconds: float, kv_ready_seconds: float, nbytes: int, blocks: int
    ) -> None:
        self.data["pull_seconds"].append(seconds)
        self.data["kv_ready_seconds"].append(kv_ready_seconds)
        self.data["pull_bytes"].append(nbytes)
        self.data["pull_blocks"].append(blocks)

    def record(self, counter: str, n: int = 1) -> None:
        if counter not in _COUNTS:
            raise KeyError(f"unknown counter {counter!r}; known: {', '.join(_COUNTS)}")
        self.data[counter].append(n)

    def record_misconfigured(self, kind: str, n: int) -> None:
        self.data.setdefault(f"{MISCONFIGURED}:{kind}", []).append(n)

    def misconfigured(self) -> dict[str, int]:
        """Misconfigured requests by kind."""
        return _misconfigured(self.data)

    def clone_and_reset(self) -> HixlKVConnectorStats:
        snapshot = copy.deepcopy(self)
        self.reset()
        return snapshot

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, values in other.data.items():
            self.data.setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data["pull_seconds"])
        ready = sorted(self.data["kv_ready_seconds"])
        total_bytes = sum(self.data["pull_bytes"])
        busy = sum(seconds)
        return {
            "Num pulls": len(seconds),
            "Blocks pulled": int(sum(self.data["pull_blocks"])),
            "MB pulled": round(total_bytes / 1e6, 3),
            "Avg pull ms": round(1e3 * busy / len(seconds), 3) if seconds else 0,
            "P90 pull ms": round(1e3 * _percentile(seconds, 0.9), 3),
            "P90 KV-ready ms": round(1e3 * _percentile(ready, 0.9), 3),
            "GB/s": round(total_bytes / busy / 1e9, 3) if busy > 0 else 0,
            **{_label(name): int(sum(self.data[name])) for name in _COUNTS},
            **{_label(f"misconfigured {kind}"): n for kind, n in self.misconfigured().items()},
        }


def _misconfigured(data: Mapping[str, list[float]]) -> dict[str, int]:
    prefix = MISCONFIGURED + ":"
    return {
        key[len(prefix) :]: int(sum(values))
        for key, values in data.items()
        if key.startswith(prefix)
    }


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _label(counter: str) -> str:
    return "Num " + counter.replace("_", " ")


class HixlPromMetrics(KVConnectorPromMetrics):
    """Counters `vllm:hixl_*_total` and histograms of pull and KV-ready seconds."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # Fine below 2 ms, where pulls and KV-ready latency of one request live on one host.
        buckets = [0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005]
        buckets += [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]

        def per_engine(metric: PromMetric) -> dict[int, PromMetric]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self._histograms = {
            name: per_engine(
                self._histogram_cls(
                    name=f"vllm:hixl_{name}",
                    documentation=f"hixl_connector {name.replace('_', ' ')} per pull.",
                    buckets=buckets,
                    labelnames=labelnames,
                )
            )
            for name in ("pull_seconds", "kv_ready_seconds")
        }

        def counter(name: str, documentation: str) -> dict[int, PromMetric]:
            return per_engine(
                self._counter_cls(
                    name=f"vllm:hixl_{name}", documentation=documentation, labelnames=labelnames
                )
            )

        self._counters = {
            name: counter(name, f"hixl_connector {name.replace('_', ' ')}.")
            for name in ("pulls", "pull_bytes", "pull_blocks", *_COUNTS)
        }
        self._aliases = {
            old: counter(old, f"hixl_connector: the old name of vllm:hixl_{new}_total.")
            for old, new in RENAMED_COUNTERS.items()
        }
        self._misconfigured = self._counter_cls(
            name=f"vllm:hixl_{MISCONFIGURED}",
            documentation="hixl_connector requests that show a misconfigured deployment.",
            labelnames=[*labelnames, "kind"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, histogram in self._histograms.items():
            for value in transfer_stats_data.get(name, ()):
                histogram[engine_idx].observe(value)
        self._counters["pulls"][engine_idx].inc(len(transfer_stats_data.get("pull_seconds", ())))
        for name in ("pull_bytes", "pull_blocks", *_COUNTS):
            total = sum(transfer_stats_data.get(name, ()))
            if total:
                self._counters[name][engine_idx].inc(total)
        for old, new in RENAMED_COUNTERS.items():
            total = sum(transfer_stats_data.get(new, ()))
            if total:
                self._aliases[old][engine_idx].inc(total)
        labels = self.per_engine_labelvalues[engine_idx]
        for kind, n in _misconfigured(transfer_stats_data).items():
            self._misconfigured.labels(*labels, kind).inc(n)
