"""D side: the lease notices D sends P, "done", "release" and "heartbeat", all off the pull
threads.

Best effort: P's lease expiry frees the blocks anyway; only promptness is lost. They run on
their own threads, never queued behind pulls, so a stalled pull cannot let the leases of
other waiting requests expire. Notices to linked peers and those to addresses no handshake
vouched for (named by clients in kv_transfer_params, maybe dead) use separate threads, so
the latter cannot hold up the former.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from hixl_connector.heartbeats import DueHeartbeat, HeartbeatSchedule
from hixl_connector.metadata import PeerRank, ReleaseSpec, RemoteEndpoint
from hixl_connector.notifications import MAX_NOTIFICATION_ITEMS, LeaseNotice, Notification
from hixl_connector.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)


class LeaseNotifier:
    """``targets(remote)``: the P ranks this D rank notifies, each with the number of distinct
    D ranks that P rank waits for (see tp_mapping); ``rank``: this D rank."""

    def __init__(
        self,
        client_for: Callable[[PeerRank], SideChannelClient],
        is_linked: Callable[[PeerRank], bool],
        targets: Callable[[RemoteEndpoint], Mapping[int, int]],
        heartbeat_s: float,
        rank: int,
        record: Callable[[str], None],
    ) -> None:
        self._client_for = client_for
        self._is_linked = is_linked
        self._targets = targets
        self._rank = rank
        self._record = record  # counts "failed_notifications"
        self._heartbeats = HeartbeatSchedule(heartbeat_s)
        self._linked = ThreadPoolExecutor(1, thread_name_prefix="hixl-notices")
        self._unlinked = ThreadPoolExecutor(1, thread_name_prefix="hixl-notices-new")

    def release_later(self, spec: ReleaseSpec, kind: str = "release") -> None:
        """Queues a notice to every P rank this D rank answers for: "done" after a good read,
        "release" when nothing was or will be read (nothing to pull, aborted first, failed).
        P frees on either."""
        for target, consumers in self._ranks(spec.remote):
            self._lane(target).submit(
                self._release_rank, target, spec.remote_request_id, spec.lease_id, consumers, kind
            )

    def _release_rank(
        self,
        target: PeerRank,
        remote_request_id: str,
        lease_id: int,
        consumers: int,
        kind: str,
    ) -> None:
        notice = LeaseNotice(remote_request_id, lease_id, consumers, rank=self._rank)
        try:
            client = self._client_for(target)
        except (ValueError, RuntimeError) as e:
            logger.warning("hixl: %s for %s not sent: %s", kind, remote_request_id, e)
            return
        try:
            client.request(Notification(kind, (notice,)).to_dict())
        except SideChannelError as e:
            self._record("failed_notifications")
            logger.warning("hixl: %s for %s not delivered: %s", kind, remote_request_id, e)
        finally:
            client.close()

    def heartbeats(self, beats: list[tuple[RemoteEndpoint, str, int]], now: float) -> None:
        """Schedules this step's heartbeats for the leases D still waits on, to every P rank
        that holds one of them for this D rank."""
        per_rank = [
            (target, remote_request_id, lease_id)
            for remote, remote_request_id, lease_id in beats
            for target, _ in self._ranks(remote)
        ]
        for due in self._heartbeats.due(per_rank, now):
            self._lane(due.target).submit(self._heartbeat, due)

    def tracked_peers(self) -> int:
        return self._heartbeats.tracked_peers()

    def shutdown(self) -> None:
        self._linked.shutdown(wait=True, cancel_futures=True)
        self._unlinked.shutdown(wait=True, cancel_futures=True)

    def _ranks(self, remote: RemoteEndpoint) -> list[tuple[PeerRank, int]]:
        try:
            return [(remote.rank(p), n) for p, n in self._targets(remote).items()]
        except ValueError as e:  # params named ranks or ports that cannot exist
            logger.warning("hixl: no lease notice to %s: %s", remote.engine_id, e)
            return []

    def _lane(self, target: PeerRank) -> ThreadPoolExecutor:
        return self._linked if self._is_linked(target) else self._unlinked

    def _heartbeat(self, due: DueHeartbeat) -> None:
        try:
            client = self._client_for(due.target)
            try:
                for first in range(0, len(due.items), MAX_NOTIFICATION_ITEMS):
                    batch = due.items[first : first + MAX_NOTIFICATION_ITEMS]
                    client.request(Notification("heartbeat", batch).to_dict())
            finally:
                client.close()
        except Exception as e:  # a lost heartbeat costs a lease, never the worker
            self._record("failed_notifications")
            logger.warning("hixl: heartbeat to %s failed: %s", due.target.remote.engine_id, e)
        finally:
            self._heartbeats.finished(due.key)
