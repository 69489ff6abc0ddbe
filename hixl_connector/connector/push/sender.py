"""P side of push mode, one worker rank: matches each prefill with the D rank that
registered its blocks for it, and writes the KV there (``request_push``).

The two halves meet by base request id (vllm-router sends P's and D's legs with one
X-Request-Id), in any order. D's registration (``push_register`` on the side channel) may
come before P's forward computes the prompt, while it does, or after the prefill finished:
- before or during: the layers are written as the forward computes them (``computing``,
  ``layer_saved``), the rest and the word once the prefill finished (``hold``);
- after: everything once both are here.
Each half is kept until its partner arrives: a registration as long as its D waits (it says
how long), at most ``MAX_WAITING_REGISTRATIONS`` of them; a finished prefill as long as its
lease lives. Where D's TP size is larger, several D ranks register for one prompt, each by
its rank, and the lease ends once every one of them was pushed. Only prompts a step
computes to their end are written layer by layer (a prompt prefilled in chunks is written
whole once finished).

A small pool (``transfer_threads``) writes, a request at a time per thread, each request's
writes in order. A D that does not answer holds a thread for up to ``pull_timeout_s`` per
write (the engine's bound on one write). A push P gives up on (a failed write, a lease that
ended first, a prompt that finished without a lease: aborted, not deliverable) is logged,
counted and kept for as long as its D waits, to answer D's ``push_status`` question
(``push.status``): D then fails the request at once. A D that registers for a prompt
that already finished without a lease is refused at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.leases.server import LeaseTable
from hixl_connector.connector.metadata import PromptBlocks, SendSpec
from hixl_connector.connector.push.registration import PushRegistration
from hixl_connector.connector.push.request_push import (
    RequestPush,
    layer_ranges,
    source_blocks,
)
from hixl_connector.connector.push.status import GaveUp, PushStatusQuery, answer
from hixl_connector.connector.transfer_params import base_request_id

logger = logging.getLogger(__name__)

MAX_WAITING_REGISTRATIONS = 4096
# How long a prompt that finished without a lease refuses a late registration: longer than a
# D's registration may trail P's leg (both legs leave the router together).
NOT_PUSHED_KEEP_S = 60.0
T = TypeVar("T")


class PushSender:
    """``layers``: the registered layer index of each attention layer's name; ``state``:
    where a hybrid state model's states lie (None: it has none)."""

    def __init__(
        self,
        kv: RegisteredKV,
        leases: LeaseTable,
        layers: Mapping[str, int],
        threads: int,
        record: Callable[[str, int], None],
        wake: Callable[[], None],
        state: StateLayout | None = None,
    ) -> None:
        if kv.lease_words is None:
            raise ValueError("push mode needs the prefill engine's lease words registered")
        self._kv = kv
        self._leases = leases
        self._state = state
        self._num_layers = len(set(layers.values()))
        self._record = record
        self._wake = wake
        self._lock = threading.Lock()
        # base request id -> D rank -> (registration, until when that D waits for the
        # prefill).
        self._registered: dict[str, dict[int, tuple[PushRegistration, float]]] = {}
        # base request id -> the lease of a finished prefill, until it ends: waits for its
        # Ds' registrations.
        self._finished: dict[str, SendSpec] = {}
        # base request id -> D rank -> (a push begun while P computed, until when D waits).
        self._begun: dict[str, dict[int, tuple[RequestPush, float]]] = {}
        # While a forward runs: the prompts it computes to their end, the layers it computed.
        self._computing: dict[str, PromptBlocks] = {}
        self._layers_computed = ComputedLayers(layers)
        # (D's cluster id, base request id) -> (until when that D waits, why P gave up).
        self._gave_up: dict[tuple[int, str], tuple[float, GaveUp]] = {}
        # base request id -> until when: prompts that finished without a lease.
        self._not_pushed: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hixl-push")

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {"push_register": self._on_register, "push_status": self._on_status}

    def hold(self, sends: Iterable[SendSpec]) -> None:
        """The prefills the last step finished: each is pushed (or its push finished) once
        its D registered."""
        with self._lock:
            self._expire(time.monotonic())
            for send in sends:
                if send.block_ids:
                    base = base_request_id(send.request_id)
                    self._finished[base] = send
                    self._match(base)

    def not_pushed(self, request_ids: Iterable[str]) -> None:
        """Prompts that finished without a lease: the Ds registered for them are told none
        comes (their next ``push_status``), a push begun while P computed writes no more,
        and a D registering later is refused."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        why = GaveUp("P's prefill ended without KV for D (aborted, or not deliverable)", False)
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            for request_id in request_ids:
                base = base_request_id(request_id)
                self._not_pushed[base] = now + NOT_PUSHED_KEEP_S
                if len(self._not_pushed) > MAX_WAITING_REGISTRATIONS:
                    del self._not_pushed[next(iter(self._not_pushed))]  # the oldest
                waiting = [r for r, _ in self._registered.pop(base, {}).values()]
                for push, _ in self._begun.pop(base, {}).values():
                    push.drop()
                    waiting.append(push.registration)
                for registration in waiting:
                    self._note_gave_up_locked(registration, why)

    def computing(self, prompts: Iterable[PromptBlocks]) -> None:
        """Before a forward: the prompts it computes to their end."""
        with self._lock:
            self._computing = {base_request_id(p.request_id): p for p in prompts}
            self._layers_computed.begin()
            for base in self._computing:
                if base in self._registered:
                    self._begin(base)

    def layer_saved(self, layer_name: str) -> None:
        """The forward computed ``layer_name`` of every prompt in it."""
        if not self._computing:
            return
        with self._lock:
            layer = self._layers_computed.computed(layer_name)
            if layer is None:
                return
            for base in self._computing:
                for push, _ in self._begun.get(base, {}).values():
                    push.write_layers(range(layer, layer + 1))

    def computed(self) -> None:
        """The forward ended: a registration from now on waits for the finished prefill."""
        with self._lock:
            self._computing = {}
            self._layers_computed.begin()

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
        base = registration.request
        with self._lock:
            self._expire(time.monotonic())
            waiting = self._registered.values(), self._begun.values()
            if sum(len(ranks) for kind in waiting for ranks in kind) >= MAX_WAITING_REGISTRATIONS:
                raise ValueError(
                    f"{MAX_WAITING_REGISTRATIONS} push registrations already wait for their "
                    "prefill on this rank"
                )
            if base in self._not_pushed:
                raise ValueError(
                    f"request {base}: P's prefill ended without KV for D (aborted, or not "
                    "deliverable); nothing will be pushed"
                )
            if base not in self._finished:
                # D registered while P still prefills: the router sent both legs at once.
                self._record("early_push_registrations", 1)
            until = time.monotonic() + registration.wait_s
            self._registered.setdefault(base, {})[registration.rank] = (registration, until)
            if base in self._computing:
                self._begin(base)
            else:
                self._match(base)
        return {}

    def _on_status(self, message: dict[str, Any]) -> dict[str, Any]:
        query = PushStatusQuery.from_dict(message)
        with self._lock:
            self._expire(time.monotonic())
            keys = [(query.cluster_id, request) for request in query.requests]
            return answer({key[1]: self._gave_up[key][1] for key in keys if key in self._gave_up})

    def _note_gave_up(self, registration: PushRegistration, gave_up: GaveUp) -> None:
        """Keeps why P will not push this request for as long as its D waits."""
        with self._lock:
            self._note_gave_up_locked(registration, gave_up)

    def _note_gave_up_locked(self, registration: PushRegistration, gave_up: GaveUp) -> None:
        if len(self._gave_up) >= MAX_WAITING_REGISTRATIONS:
            del self._gave_up[next(iter(self._gave_up))]  # the oldest
        until = time.monotonic() + registration.wait_s
        self._gave_up[(registration.cluster_id, registration.request)] = (until, gave_up)

    def _expire(self, now: float) -> None:
        """Forgets the registrations whose D gave up waiting (lock held)."""
        _drop_expired(self._registered, now)
        _drop_expired(self._begun, now)
        for key in [key for key, (until, _) in self._gave_up.items() if until <= now]:
            del self._gave_up[key]
        for base in [base for base, until in self._not_pushed.items() if until <= now]:
            del self._not_pushed[base]

    def _begin(self, base: str) -> None:
        """The forward computes ``base``'s prompt and its Ds registered: its layers are
        written from now on, those computed already first (lock held)."""
        registered = self._registered.get(base, {})
        for rank, (registration, until) in list(registered.items()):
            if not registration.blocks:
                continue  # this D takes nothing: it is done once the prefill finished
            blocks = self._computing[base].block_ids
            try:
                src = source_blocks(blocks, registration, len(self._kv.caches))
            except ValueError:
                continue  # refused once the prefill finished, where it is counted
            del registered[rank]
            push = self._new_push(registration, src)
            for layers in layer_ranges(self._layers_computed.layers):
                push.write_layers(layers)
            self._begun.setdefault(base, {})[rank] = (push, until)
        if not registered:
            self._registered.pop(base, None)

    def _new_push(self, registration: PushRegistration, src: tuple[int, ...]) -> RequestPush:
        return RequestPush(
            self._kv,
            registration,
            src,
            self._num_layers,
            self._pool,
            self._record,
            self._note_gave_up,
            self._state,
        )

    def _match(self, base: str) -> None:
        """Finishes the pushes of ``base`` whose halves are both here (lock held)."""
        send = self._finished.get(base)
        if send is None:
            return
        pushes = [push for push, _ in self._begun.pop(base, {}).values()]
        pushes += [
            self._new_push(registration, ())
            for registration, _ in self._registered.pop(base, {}).values()
        ]
        for push in pushes:
            push.finish(send, self._leases, self._wake)


class ComputedLayers:
    """The registered layers a forward computed, from the layer names ``save_kv_layer``
    gives (``layers``: each name's registered layer). Under the hybrid KV-cache manager a
    registered layer is one buffer that a layer of each KV-cache group shares: it is
    computed once every one of them was, and only then may it be written."""

    def __init__(self, layers: Mapping[str, int]) -> None:
        self._layers = dict(layers)
        self._names: dict[int, set[str]] = {}
        for name, layer in self._layers.items():
            self._names.setdefault(layer, set()).add(name)
        self._waiting: dict[int, set[str]] = {}  # registered layer -> names not computed yet
        self.layers: set[int] = set()

    def begin(self) -> None:
        """A forward begins: nothing computed yet."""
        self._waiting = {layer: set(names) for layer, names in self._names.items()}
        self.layers = set()

    def computed(self, name: str) -> int | None:
        """The layer ``name`` was computed: its registered layer where that completes it."""
        layer = self._layers.get(name)
        waiting = self._waiting.get(layer) if layer is not None else None
        if layer is None or waiting is None:
            return None  # not registered, or computed already
        waiting.discard(name)
        if waiting:
            return None
        del self._waiting[layer]
        self.layers.add(layer)
        return layer


def _drop_expired(waiting: dict[str, dict[int, tuple[T, float]]], now: float) -> None:
    """Forgets what waited past its D's wait, by request and D rank."""
    for base, ranks in list(waiting.items()):
        for rank in [rank for rank, (_, until) in ranks.items() if until <= now]:
            del ranks[rank]
        if not ranks:
            del waiting[base]
