"""D side: the lease notices D sends P outside a pull, "release" and "heartbeat".

Best effort: P's lease expiry frees the blocks anyway; only promptness is lost. They run on
their own threads, never queued behind pulls, so a stalled pull cannot let the leases of
other waiting requests expire. Notices to linked peers and those to addresses no handshake
vouched for (named by clients in kv_transfer_params, maybe dead) use separate threads, so
the latter cannot hold up the former.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hixl_connector.heartbeats import DueHeartbeat, HeartbeatSchedule
from hixl_connector.metadata import ReleaseSpec, RemoteEndpoint
from hixl_connector.notifications import MAX_NOTIFICATION_ITEMS, LeaseNotice, Notification
from hixl_connector.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)


class LeaseNotifier:
    def __init__(
        self,
        client_for: Callable[[RemoteEndpoint], SideChannelClient],
        is_linked: Callable[[RemoteEndpoint], bool],
        heartbeat_s: float,
        tp_size: int,
        record: Callable[[str], None],
    ) -> None:
        self._client_for = client_for
        self._is_linked = is_linked
        self._tp_size = tp_size
        self._record = record  # counts "failed_notifications"
        self._heartbeats = HeartbeatSchedule(heartbeat_s)
        self._linked = ThreadPoolExecutor(1, thread_name_prefix="hixl-notices")
        self._unlinked = ThreadPoolExecutor(1, thread_name_prefix="hixl-notices-new")

    def release_later(self, spec: ReleaseSpec) -> None:
        """Queues a release the scheduler asked for: nothing to pull, or aborted first."""
        self._lane(spec.remote).submit(
            self.release, spec.remote, spec.remote_request_id, spec.lease_id
        )

    def release(self, remote: RemoteEndpoint, remote_request_id: str, lease_id: int) -> None:
        """Tells P now (on the caller's thread) that D is done with the lease."""
        notice = LeaseNotice(remote_request_id, lease_id, remote.consumers(self._tp_size))
        try:
            client = self._client_for(remote)
        except (ValueError, RuntimeError) as e:
            logger.warning("hixl: release for %s not sent: %s", remote_request_id, e)
            return
        try:
            client.request(Notification("release", (notice,)).to_dict())
        except SideChannelError as e:
            self._record("failed_notifications")
            logger.warning("hixl: release for %s not delivered: %s", remote_request_id, e)
        finally:
            client.close()

    def heartbeats(self, beats: list[tuple[RemoteEndpoint, str, int]], now: float) -> None:
        """Schedules this step's heartbeats for the leases D still waits on."""
        for due in self._heartbeats.due(beats, now):
            self._lane(due.remote).submit(self._heartbeat, due)

    def tracked_peers(self) -> int:
        return self._heartbeats.tracked_peers()

    def shutdown(self) -> None:
        self._linked.shutdown(wait=True, cancel_futures=True)
        self._unlinked.shutdown(wait=True, cancel_futures=True)

    def _lane(self, remote: RemoteEndpoint) -> ThreadPoolExecutor:
        return self._linked if self._is_linked(remote) else self._unlinked

    def _heartbeat(self, due: DueHeartbeat) -> None:
        try:
            client = self._client_for(due.remote)
            try:
                for first in range(0, len(due.items), MAX_NOTIFICATION_ITEMS):
                    batch = due.items[first : first + MAX_NOTIFICATION_ITEMS]
                    client.request(Notification("heartbeat", batch).to_dict())
            finally:
                client.close()
        except Exception as e:  # a lost heartbeat costs a lease, never the worker
            self._record("failed_notifications")
            logger.warning("hixl: heartbeat to %s failed: %s", due.remote.engine_id, e)
        finally:
            self._heartbeats.finished(due.key)
