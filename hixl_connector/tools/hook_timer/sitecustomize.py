"""Loaded by every Python process started with this folder first on PYTHONPATH and
``HIXL_HOOK_TIMES`` set: once ``hixl_connector.connector.facade`` is imported, each hook of
HixlConnector is timed, and every DUMP_EVERY_S the process writes, to
``$HIXL_HOOK_TIMES.<pid>.json``, its connector's engine and role, each hook's calls and
nanoseconds (those over WAIT_NS apart: an idle step's wait, not a step's cost) and each of
its threads' CPU ticks. A profiling aid for bench-serve, never loaded by the connector."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from hixl_connector.tools.hook_timer.after_import import after_import

ENV = "HIXL_HOOK_TIMES"
FACADE = "hixl_connector.connector.facade"
HOOKS = (
    "build_connector_meta",
    "update_connector_output",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)
WAIT_NS = 500_000
DUMP_EVERY_S = 2.0


def time_hooks(cls: type, stats: dict[str, list[int]], role: dict[str, str]) -> None:
    """Wraps ``cls``'s own ``HOOKS`` to count into ``stats`` (hook: [calls, ns, waits,
    ns waiting]) and its ``__init__`` to note the engine and role into ``role``."""
    init = cls.__init__  # type: ignore[misc]

    def noted_init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, vllm_config, *args, **kwargs)
        kv = vllm_config.kv_transfer_config
        role["engine"] = f"{kv.engine_id} {kv.kv_role}"

    cls.__init__ = noted_init  # type: ignore[misc]
    for name in HOOKS:
        hook = cls.__dict__.get(name)
        if callable(hook):
            setattr(cls, name, _timed(hook, stats.setdefault(name, [0, 0, 0, 0])))


def _timed(hook: Callable[..., Any], counts: list[int]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter_ns()
        try:
            return hook(self, *args, **kwargs)
        finally:
            took = time.perf_counter_ns() - began
            counts[0] += 1
            counts[1] += took
            if took > WAIT_NS:
                counts[2] += 1
                counts[3] += took

    timed.__wrapped__ = hook  # type: ignore[attr-defined]
    return timed


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU ticks (user and system) of each thread of process ``pid``, by name and id."""
    ticks = {}
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields: Sequence[str] = stat[stat.rindex(")") + 2 :].split()
        ticks[f"{name}:{tid}"] = int(fields[11]) + int(fields[12])
    return ticks


def _dump(path: str, stats: dict[str, list[int]], role: dict[str, str]) -> None:
    while True:
        time.sleep(DUMP_EVERY_S)
        record = {"role": role, "hooks": stats, "threads": thread_ticks(os.getpid())}
        try:
            with open(f"{path}.{os.getpid()}.json", "w") as out:
                json.dump(record, out)
        except OSError:
            return


def _time_facade(facade: ModuleType) -> None:
    stats: dict[str, list[int]] = {}
    role: dict[str, str] = {}
    time_hooks(facade.HixlConnector, stats, role)
    args = (os.environ[ENV], stats, role)
    threading.Thread(target=_dump, args=args, daemon=True).start()


if os.environ.get(ENV):
    after_import(FACADE, _time_facade)
