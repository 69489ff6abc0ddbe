"""D's role on a worker rank: the prefill ranks it talks to (peers), the notices it sends
them (lease client), and what gets the KV here: the reader of pulls (``receiver``) and, in
push mode, the receiver of pushes (``push.receiver``). Each reports into the worker's one
``Outcomes``."""

from __future__ import annotations

import logging
import threading
import time

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.kv.decode_rank import DecodeRank
from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.leases.client import LeaseClient
from hixl_connector.connector.link_reports import LinkReporter
from hixl_connector.connector.mapping.read_plans import ReadPlans
from hixl_connector.connector.metadata import HixlConnectorMetadata
from hixl_connector.connector.outcomes import Outcomes
from hixl_connector.connector.peers.handshake import HandshakePayload
from hixl_connector.connector.peers.registry import PeerRegistry
from hixl_connector.connector.push.receiver import PushReceiver
from hixl_connector.connector.worker.receiver import Receiver

logger = logging.getLogger(__name__)


class DecodeRole:
    def __init__(
        self,
        config: HixlConfig,
        kv: RegisteredKV,
        layout: KVLayout,
        payload: HandshakePayload,
        context: zmq.Context,
        block_sizes: tuple[int, ...],
        plans: ReadPlans,
        links: LinkReporter,
        outcomes: Outcomes,
        classes: tuple[type[Receiver], type[PushReceiver]] = (Receiver, PushReceiver),
    ) -> None:
        """``classes``: what reads pulls and receives pushes (a subclass may watch or alter
        them: the tests' controls)."""
        tp_rank, cluster_id = payload.tp_rank, payload.cluster_id
        self.peers = PeerRegistry(
            kv.api, kv.datadist, context, payload, config, kv.reads_in_place, outcomes.record, links
        )
        self.lease_client = LeaseClient(
            self.peers.notice_client,
            self.peers.is_linked,
            plans.notify_targets,
            config.heartbeat_s,
            tp_rank,
            outcomes.record,
        )
        receiver_cls, push_receiver_cls = classes
        rank = DecodeRank(
            config, kv, layout, block_sizes, plans, self.peers, tp_rank, cluster_id, outcomes
        )
        self._receiver = receiver_cls(rank, self.lease_client)
        self._push_receiver = push_receiver_cls(rank) if config.pushes else None

    def bind(self, metadata: HixlConnectorMetadata, now: float) -> None:
        """Before the step's forward: registers the step's pushes with P (P writes once it
        has them) and revokes those aborted."""
        if self._push_receiver is not None:
            for push in metadata.to_push_recv:
                self._push_receiver.start(push, now)
            for request_id in metadata.to_cancel:
                self._push_receiver.cancel(request_id)

    def start_load_kv(self, metadata: HixlConnectorMetadata, now: float) -> None:
        """Starts the step's pulls (a synchronous one lands before this returns), cancels the
        aborted ones, and sends P the step's releases and heartbeats."""
        pooled = False
        for recv in metadata.to_recv:
            pooled |= self._receiver.start(recv, now)
        if any(recv.synchronous for recv in metadata.to_recv):
            self._receiver.settle_sync_loads()  # this step's forward reads their KV
        for request_id in metadata.to_cancel:
            self._receiver.cancel(request_id)
        if pooled:
            # Hands the GIL over so the pool begins its handshakes now rather than when this
            # step next blocks.
            time.sleep(0)
        self.peers.close_idle(now)
        for release in metadata.to_release:
            self.lease_client.notify("release", release)
        self.lease_client.waiting(metadata.waiting, metadata.done_waiting, now)

    def collect_reads(self, wait_s: float, woken: threading.Event) -> bool:
        """Ends the pulls that finished, waiting up to ``wait_s`` for one where any is under
        way; with none under way, waits up to ``wait_s`` for a push's word (woken early by
        ``woken``). False when there was nothing to wait for."""
        if self._receiver.in_flight():
            self._receiver.collect(wait_s)
            return True
        receiver = self._push_receiver
        # A push's word lands straight in memory: a step that slept its wait out would see
        # one up to a wait late.
        return bool(wait_s) and receiver is not None and receiver.wait_for_word(wait_s, woken)

    def collect_pushes(self) -> None:
        """Ends the pushes whose words P set, and those past their time."""
        if self._push_receiver is not None:
            self._push_receiver.collect()

    def stop(self, wait_s: float) -> None:
        """Stops taking work: handshakes and notices under way give up at once, the pools
        stop (waiting up to ``wait_s`` for a handshake under way), no more notices."""
        self.peers.stop()
        if self._push_receiver is not None:
            self._push_receiver.shutdown()
        if not self._receiver.shutdown(wait_s):
            logger.warning("hixl: a handshake still under way at shutdown is abandoned")
        self.lease_client.shutdown()

    def close(self) -> None:
        """After ``stop``: unlinks and closes the side-channel clients."""
        self.peers.close()
