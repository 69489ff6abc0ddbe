"""P's role on a worker rank: the side channel that answers D's handshakes, lease notices
and (push mode) push registrations, the leases it holds on this rank (their words and their
expiry), and in push mode what writes the KV into D (``push.sender``), told what each
forward computes."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.leases.guarded_read import LeaseWords
from hixl_connector.connector.leases.server import LeaseServer
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION, HandshakePayload
from hixl_connector.connector.peers.incarnation import IncarnationFile
from hixl_connector.connector.peers.side_channel import SideChannelServer
from hixl_connector.connector.push.sender import PushSender


class PrefillRole:
    """Serves from construction until ``close()``; ``words``: this rank's lease words, and
    the file P's scheduler writes its incarnation into after the workers start; ``layers``:
    the registered layer of each attention layer's name; ``state``: where a hybrid state
    model's states lie."""

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
        state: StateLayout | None = None,
    ) -> None:
        self._payload = payload
        self._words, self._incarnation = words
        self._leases = LeaseServer(config.lease_s, self._words, record, wake)
        # Push mode: what writes into D (the worker tells it what each forward computes).
        self._pusher: PushSender | None = None
        if config.pushes:
            self._pusher = PushSender(
                kv, self._leases.table, layers, config.transfer_threads, record, wake, state
            )
        pushing = self._pusher.handlers() if self._pusher is not None else {}
        self._server = SideChannelServer(
            context,
            config.side_channel_host,
            side_channel_port,
            {"handshake": self._on_handshake, **self._leases.handlers(), **pushing},
            self._identity,
            config.auth_token,
        )

    def bind(self, metadata: HixlConnectorMetadata) -> None:
        """The scheduler's changes for this step, before its forward: the clears of leases
        that never started, then the words of the prompts the step computes to their end
        (leases.guarded_read); the leases the scheduler took (push mode: and their pushes);
        push mode: the prompts the step computes (their layers are written as computed) and
        those that ended without a lease (never written)."""
        for clear in metadata.to_clear:
            self._words.clear(clear.slot, clear.word)
        for word in metadata.to_publish:
            self._words.publish(word.slot, word.word)
        sends = list(metadata.to_send)
        self._leases.start(sends, time.monotonic())
        if self._pusher is not None:
            self._pusher.hold(sends)
            self._pusher.not_pushed(metadata.not_pushed)
            self._pusher.computing(metadata.prefilling)

    def layer_saved(self, layer_name: str) -> None:
        """The forward computed ``layer_name``: push mode writes it to the Ds waiting."""
        if self._pusher is not None:
            self._pusher.layer_saved(layer_name)

    def computed(self) -> None:
        """The forward ended. Writes go on beside the next steps: P's lease keeps the
        blocks until the last one landed."""
        if self._pusher is not None:
            self._pusher.computed()

    def finished(self) -> set[str]:
        """The requests whose leases ended since the last call: their blocks may go."""
        finished = self._leases.finished(time.monotonic())
        if self._pusher is not None and finished:
            self._pusher.forget(finished)
        return finished

    def close(self) -> None:
        self._server.close()
        if self._pusher is not None:
            self._pusher.close()
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
