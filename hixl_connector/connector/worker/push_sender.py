"""P side of push mode, one worker rank: matches each finished prefill with the D rank that
registered its blocks for it, and writes the KV there.

The two halves meet by base request id (vllm-router sends P's and D's legs with one
X-Request-Id), in either order: D's registration (``push_register`` on the side channel)
may come before P's prefill finished, or after. Each is kept until its partner arrives: a
registration for as long as its D waits (it says how long), at most
``MAX_WAITING_REGISTRATIONS`` of them; a finished prefill as long as its lease lives.

A small pool (``transfer_threads``) writes, a request per thread: every registered KV
cache's blocks, then P's lease word into D's push word, each under D's grant, so D sees the
word set only once every block landed. The lease is pinned meanwhile (its blocks cannot be
freed under the write) and ends after the last write, ok or not: vLLM then frees P's
blocks. A failed write is logged and counted; D, which never sees its word set, times out
on its own and reports a failed receive. A D that does not answer holds a thread for up to
``pull_timeout_s`` (the engine's bound on one write).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hixl_connector.connector.leases.server import LeaseTable
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.peers.push_registration import PushRegistration
from hixl_connector.connector.transfer_params import base_request_id
from hixl_connector.connector.worker.registered_kv import PUSH_WORDS_MODEL_ID, RegisteredKV

logger = logging.getLogger(__name__)

MAX_WAITING_REGISTRATIONS = 4096


class PushSender:
    def __init__(
        self,
        kv: RegisteredKV,
        leases: LeaseTable,
        threads: int,
        record: Callable[[str, int], None],
        wake: Callable[[], None],
    ) -> None:
        if kv.lease_words is None:
            raise ValueError("push mode needs the prefill engine's lease words registered")
        self._kv = kv
        self._leases = leases
        self._record = record
        self._wake = wake
        self._lock = threading.Lock()
        # base request id -> (registration, until when its D waits for the prefill).
        self._registered: dict[str, tuple[PushRegistration, float]] = {}
        # base request id -> the lease of a finished prefill: waits for D's registration.
        self._finished: dict[str, SendSpec] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hixl-push")

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {"push_register": self._on_register}

    def hold(self, sends: Iterable[SendSpec]) -> None:
        """The prefills this step finished: each is pushed once its D registered."""
        with self._lock:
            self._expire(time.monotonic())
            for send in sends:
                if send.block_ids:
                    base = base_request_id(send.request_id)
                    self._finished[base] = send
                    self._match(base)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Leases that ended otherwise (a pulling D's "done", expiry): nothing to push."""
        with self._lock:
            for request_id in request_ids:
                base = base_request_id(request_id)
                send = self._finished.get(base)
                if send is not None and send.request_id == request_id:
                    del self._finished[base]

    def close(self) -> None:
        """Pushes not begun are dropped (their leases end with the engine)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_register(self, message: dict[str, Any]) -> dict[str, Any]:
        registration = PushRegistration.from_dict(message)
        with self._lock:
            self._expire(time.monotonic())
            if len(self._registered) >= MAX_WAITING_REGISTRATIONS:
                raise ValueError(
                    f"{MAX_WAITING_REGISTRATIONS} push registrations already wait for their "
                    "prefill on this rank"
                )
            if registration.request not in self._finished:
                # D registered while P still prefills: the router sent both legs at once.
                self._record("early_push_registrations", 1)
            until = time.monotonic() + registration.wait_s
            self._registered[registration.request] = (registration, until)
            self._match(registration.request)
        return {}

    def _expire(self, now: float) -> None:
        """Forgets the registrations whose D gave up waiting (lock held)."""
        gone = [base for base, (_, until) in self._registered.items() if until <= now]
        for base in gone:
            del self._registered[base]

    def _match(self, base: str) -> None:
        """Queues the push of ``base`` once both halves are here (lock held)."""
        if base in self._registered and base in self._finished:
            registration, _ = self._registered.pop(base)
            self._pool.submit(self._run, self._finished.pop(base), registration)

    def _run(self, send: SendSpec, registration: PushRegistration) -> None:
        if not self._leases.pin(send.request_id, send.lease_id):
            return  # ended meanwhile (expired): its blocks may be another's now
        try:
            self._push(send, registration)
            self._record("pushes", 1)
        except Exception as e:
            self._record("failed_pushes", 1)
            logger.error("hixl: push of request %s failed: %s", send.request_id, e)
        finally:
            self._leases.end(send.request_id, send.lease_id)
            self._wake()

    def _push(self, send: SendSpec, registration: PushRegistration) -> None:
        if not registration.blocks:
            return  # D takes nothing: the lease ends
        if len(registration.grants) != len(self._kv.caches):
            raise ValueError(
                f"D granted {len(registration.grants)} KV caches, this engine registers "
                f"{len(self._kv.caches)}"
            )
        beyond = [p for p in registration.positions if p >= len(send.block_ids)]
        if beyond:
            raise ValueError(
                f"D asks for prompt block {beyond[0]}, the prompt has {len(send.block_ids)}"
            )
        src_blocks = [send.block_ids[p] for p in registration.positions]
        for part, grant in zip(self._kv.caches, registration.grants, strict=True):
            units = (part.units(src_blocks), part.units(registration.blocks))
            self._kv.push(registration.cluster_id, part, part.model_id, units, grant)
        # Last: the lease word (set while the lease lives) tells D every block landed.
        assert self._kv.lease_words is not None
        slot, grant = registration.word
        words = ((send.slot,), (slot,))
        self._kv.push(
            registration.cluster_id, self._kv.lease_words, PUSH_WORDS_MODEL_ID, words, grant
        )
