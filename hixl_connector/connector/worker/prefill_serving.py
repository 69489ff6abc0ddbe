"""P's serving side of a worker rank: the side channel that answers D's handshakes, lease
notices and (push mode) push registrations, and the leases it holds on this rank (their
words and their expiry)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.connector.leases.server import LeaseServer
from hixl_connector.connector.metadata import SendSpec, WordSpec
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION, HandshakePayload
from hixl_connector.connector.peers.incarnation import IncarnationFile
from hixl_connector.connector.peers.side_channel import SideChannelServer
from hixl_connector.connector.push.sender import PushSender


class PrefillServing:
    """Serves from construction until ``close()``; ``words``: this rank's lease words, and
    the file P's scheduler writes its incarnation into after the workers start; ``layers``:
    the registered layer of each attention layer's name."""

    def __init__(
        self,
        context: zmq.Context,
        config: HixlConfig,
        side_channel_port: int,
        payload: HandshakePayload,
        words: tuple[LeaseWords, IncarnationFile],
        record: Callable[[str, int], None],
        wake: Callable[[], None],
        kv: RegisteredKV,
        layers: Mapping[str, int],
    ) -> None:
        self._payload = payload
        self._words, self._incarnation = words
        self._leases = LeaseServer(config.lease_s, self._words, record, wake)
        # Push mode: what writes into D (the worker tells it what each forward computes).
        self.pusher: PushSender | None = None
        if config.transfer_mode == "push":
            self.pusher = PushSender(
                kv, self._leases.table, layers, config.transfer_threads, record, wake
            )
        pushing = self.pusher.handlers() if self.pusher is not None else {}
        self._server = SideChannelServer(
            context,
            config.side_channel_host,
            side_channel_port,
            {"handshake": self._on_handshake, **self._leases.handlers(), **pushing},
            self._identity,
            config.auth_token,
        )

    def publish(self, clears: Iterable[WordSpec], words: Iterable[WordSpec]) -> None:
        """The scheduler's word changes for this step, before its forward: the clears of
        leases that never started, then the words of the prompts the step computes to their
        end (leases.guarded_read)."""
        for clear in clears:
            self._words.clear(clear.slot, clear.word)
        for word in words:
            self._words.publish(word.slot, word.word)

    def hold(self, sends: Iterable[SendSpec]) -> None:
        """Starts the leases the scheduler took this step (push mode: and their pushes)."""
        sends = list(sends)
        self._leases.start(sends, time.monotonic())
        if self.pusher is not None:
            self.pusher.hold(sends)

    def finished(self) -> set[str]:
        """The requests whose leases ended since the last call: their blocks may go."""
        finished = self._leases.finished(time.monotonic())
        if self.pusher is not None and finished:
            self.pusher.forget(finished)
        return finished

    def close(self) -> None:
        self._server.close()
        if self.pusher is not None:
            self.pusher.close()
        self._incarnation.unlink()  # normally gone already: the scheduler unlinks it

    def _on_handshake(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"peer speaks schema {message.get('schema')!r}, this engine {SCHEMA_VERSION}"
            )
        # The side channel served it only if it names this rank and incarnation.
        return {"payload": {**self._payload.to_dict(), "incarnation": self._incarnation.nonce}}

    def _identity(self) -> Destination:
        """What a request to this rank must name (incarnation 0 until P's scheduler wrote
        it: until then every request is refused as too early)."""
        return Destination(self._payload.engine_id, self._payload.tp_rank, self._incarnation.nonce)
