"""TEST ONLY: HixlConnector with the two controls the tests need; never shipped.

vLLM loads it through ``kv_connector_module_path`` (``tests/support`` is on the tests'
PYTHONPATH). Its controls travel in ``kv_connector_extra_config`` and are taken out before
HixlConnector validates the rest:

- ``test_corrupt_received_kv``: D overwrites what it received with noise before vLLM uses
  it: the corrupted-KV control, which must change the output;
- ``test_pull_delay_s``: D waits this long (on its pool, never on the step thread) between its
  first read of P's lease words and its read of the blocks (the one batch of a read made two),
  so a fault (an expired lease, a stopped P, a cut link) lands mid-pull. Every read is then
  asynchronous (``load_in_step_bytes`` 0 unless the config sets it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hixl_connector.connector.facade import HixlConnector
from hixl_connector.connector.leases.guarded_read import GuardedPull
from hixl_connector.connector.metadata import PeerRank, RecvSpec
from hixl_connector.connector.peers.registry import Peer
from hixl_connector.connector.worker.receiver import Receiver

CONTROLS = ("test_corrupt_received_kv", "test_pull_delay_s")
MODULE = "hixl_test_connector"


def with_controls(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a --kv-transfer-config) naming this connector when its extra config holds
    a control; unchanged otherwise."""
    extra = config.get("kv_connector_extra_config", {})
    if not any(key in extra for key in CONTROLS):
        return config
    return {**config, "kv_connector": "HixlTestConnector", "kv_connector_module_path": MODULE}


class ControlledReceiver(Receiver):
    corrupt = False
    delay_s = 0.0

    def _peers_now(
        self, spec: RecvSpec, lookup: Callable[[PeerRank], Peer | None]
    ) -> dict[int, Peer] | None:
        # A delayed read waits on the pool, never on the step thread.
        return None if self.delay_s else super()._peers_now(spec, lookup)

    def _submit(self, spec: RecvSpec, pull: GuardedPull[Any]) -> tuple[Any, float]:
        if not self.delay_s:
            return super()._submit(spec, pull)
        # The one batch split where the delay goes: what lands is the same, in the same
        # order, with time for a fault in between.
        self._engine.submit(pull.pulls[: pull.words]).wait()
        time.sleep(self.delay_s)
        return super()._submit(spec, dataclasses.replace(pull, pulls=pull.pulls[pull.words :]))

    def _received(self, spec: RecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        if self.corrupt:
            import torch

            index = torch.tensor(spec.local_block_ids, dtype=torch.long)
            for view in self._layout.views:
                noise = torch.randn(view[index].shape, dtype=torch.float32) * 5
                view[index] = noise.to(view.dtype)
        super()._received(spec, nbytes, pull_s, ready_s)


def controlled_receiver(corrupt: bool = False, delay_s: float = 0.0) -> type[Receiver]:
    if not isinstance(corrupt, bool) or not isinstance(delay_s, (int, float)) or delay_s < 0:
        raise ValueError(f"test controls: corrupt={corrupt!r}, delay_s={delay_s!r}")
    return type(
        "ControlledReceiver", (ControlledReceiver,), {"corrupt": corrupt, "delay_s": delay_s}
    )


class HixlTestConnector(HixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        controls = {key: extra.pop(key) for key in CONTROLS if key in extra}
        if controls.get("test_pull_delay_s"):
            # The delay waits on the pool between the words and the blocks, so the read of a
            # delayed request cannot land before the forward of the step that needs it.
            extra.setdefault("load_in_step_bytes", 0)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            extra.update(controls)  # the other role's connector takes them too
        if self._worker is not None:
            self._worker.receiver_cls = controlled_receiver(
                controls.get("test_corrupt_received_kv", False),
                controls.get("test_pull_delay_s", 0.0),
            )
