"""TEST ONLY: HixlConnector with the controls the tests need; never shipped.

vLLM loads it through ``kv_connector_module_path`` (``tests/support`` is on the tests'
PYTHONPATH). Its controls travel in ``kv_connector_extra_config`` and are taken out before
HixlConnector validates the rest:

- ``test_corrupt_received_kv``: D overwrites what it received with noise before vLLM uses
  it, which must change the output. ``true`` corrupts every layer; a string, only the layers
  whose names start with it (a speculative draft's, say).
- ``test_state_control``: ``true`` lets a request turn a control of a hybrid state model's
  state alone on for itself, through its id (the X-Request-Id it was sent with):
  ``state_control_id("corrupt")``: D overwrites the state slots it received with noise;
  ``state_control_id("skip")``: D never reads them (its slots keep whatever they held).
  Either must change the output: the state carried the prompt. Other requests on the same
  server are read as by the production connector.
- ``test_log_kv_digests``: the bytes themselves, compared across processes. P logs a digest
  of each request's prompt blocks as its forward left them (every TP rank its own), and D a
  digest of the blocks it received, before vLLM uses them, under P's request id
  (``DIGEST_LOG``).

Everything else is the production connector, reads included.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hixl_connector.connector.facade import HixlConnector
from hixl_connector.connector.kv.decode_rank import DecodeRank
from hixl_connector.connector.metadata import PushRecvSpec, RecvSpec
from hixl_connector.connector.push.receiver import PushReceiver
from hixl_connector.connector.worker.receiver import Receiver

CORRUPT = "test_corrupt_received_kv"
DIGESTS = "test_log_kv_digests"
STATE = "test_state_control"
STATE_CONTROLS = ("corrupt", "skip")
# A request id holding this and a control's name: that control, for that request.
STATE_CONTROL_MARK = "hixl-test-state-"
CONTROLS = (CORRUPT, DIGESTS, STATE)
MODULE = "hixl_test_connector"
# P: "<side> <request> <rank> <blocks> <sha256>"; side is "prefill" or "decode".
DIGEST_LOG = "hixl-test kv digest: %s %s %d %d %s"

logger = logging.getLogger("hixl_test_connector")


def with_controls(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a --kv-transfer-config) naming this connector when its extra config holds
    a control; unchanged otherwise."""
    if not set(CONTROLS) & set(config.get("kv_connector_extra_config", {})):
        return config
    return {**config, "kv_connector": "HixlTestConnector", "kv_connector_module_path": MODULE}


def state_control_id(control: str, unique: str) -> str:
    """An X-Request-Id that turns state ``control`` on for its request (``unique``: the rest
    of the id)."""
    assert control in STATE_CONTROLS, control
    return f"{STATE_CONTROL_MARK}{control}-{unique}"


def state_control(request_id: str) -> str:
    """The state control ``request_id`` asks for (one of STATE_CONTROLS), or ""."""
    return next((c for c in STATE_CONTROLS if f"{STATE_CONTROL_MARK}{c}-" in request_id), "")


def digest(views: Sequence[Any], block_ids: Sequence[int]) -> str:
    """sha256 of the blocks' bytes in every registered view, in registration order."""
    import torch

    index = torch.tensor(list(block_ids), dtype=torch.long)
    sha = hashlib.sha256()
    for view in views:
        sha.update(view[index].contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


class CheckingReceiver:
    """Before a Receiver (pulled KV) or a PushReceiver (pushed KV) reports blocks received."""

    # The registered layers (in registration order) to corrupt: all if None, none if ().
    corrupted_layers: tuple[int, ...] | None = ()
    log_digests = False
    state_controls = False  # a request may ask for a state control (state_control_id)
    _rank: DecodeRank

    def start(self, spec: RecvSpec, queued_at: float) -> bool:
        if self.state_controls and state_control(spec.request_id) == "skip":
            spec = replace(spec, state_block_ids=())
        return super().start(spec, queued_at)  # type: ignore[misc]

    def _received(
        self, spec: RecvSpec | PushRecvSpec, nbytes: int, pull_s: float, ready_s: float
    ) -> None:
        import torch

        if self.log_digests:
            blocks = spec.local_block_ids
            logger.warning(
                DIGEST_LOG,
                "decode",
                spec.remote_request_id,
                self._rank.tp_rank,
                len(blocks),
                digest(self._rank.layout.views, blocks),
            )
        index = torch.tensor(spec.local_block_ids, dtype=torch.long)
        chosen = self.corrupted_layers
        per_layer = self._rank.layout.tensors_per_layer
        for i, view in enumerate(self._rank.layout.views):
            if chosen is None or i // per_layer in chosen:
                noise = torch.randn(view[index].shape, dtype=torch.float32) * 5
                view[index] = noise.to(view.dtype)
        state = self._rank.layout.state
        corrupt_state = self.state_controls and state_control(spec.request_id) == "corrupt"
        if corrupt_state and isinstance(spec, RecvSpec) and state is not None:
            slots = torch.tensor([local for _, _, local in spec.state_block_ids], dtype=torch.long)
            for view in state.views:
                # bf16 noise: valid values in bf16 parts and in the high halves of fp32 ones.
                noise = torch.randn(view[slots].numel() // 2, dtype=torch.float32) * 5
                view[slots] = noise.to(torch.bfloat16).view(torch.uint8).view(view[slots].shape)
        super()._received(spec, nbytes, pull_s, ready_s)  # type: ignore[misc]


def layers_named(names: list[str], prefix: str) -> tuple[int, ...]:
    """The indices of the layers named ``prefix``...; refuses a prefix that names none, so a
    control that corrupts nothing cannot pass for one that does."""
    layers = tuple(i for i, name in enumerate(names) if name.startswith(prefix))
    if not layers:
        raise ValueError(f"{CORRUPT}: no KV layer starts with {prefix!r}; layers: {names}")
    return layers


class HixlTestConnector(HixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        controls = {key: extra.pop(key, False) for key in CONTROLS}
        corrupt, digests, state = controls[CORRUPT], controls[DIGESTS], controls[STATE]
        if not isinstance(state, bool):
            raise ValueError(f"{STATE} must be a bool, got {state!r}")
        if not isinstance(corrupt, (bool, str)) or corrupt == "":
            raise ValueError(f"{CORRUPT} must be a bool or a layer-name prefix, got {corrupt!r}")
        if not isinstance(digests, bool):
            raise ValueError(f"{DIGESTS} must be a bool, got {digests!r}")
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            extra.update(controls)  # the other role's connector takes them too
        self._corrupt = corrupt
        self._digests = digests
        # Scheduler (P): prompt blocks of requests finished since the last step's metadata.
        self._finished_blocks: dict[str, list[int]] = {}
        if self._worker is not None:
            checks = {
                "corrupted_layers": None if corrupt is True else (),
                "log_digests": digests,
                "state_controls": state,
            }
            self._worker.receiver_cls = type("TestReceiver", (CheckingReceiver, Receiver), checks)
            self._worker.push_receiver_cls = type(
                "TestPushReceiver", (CheckingReceiver, PushReceiver), checks
            )

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is not None and isinstance(self._corrupt, str):
            # The layout registers the layers in the order vLLM hands them over (no buffer
            # is shared without the hybrid manager, which this control is not used with).
            chosen = layers_named(list(kv_caches), self._corrupt)
            corrupting = {"corrupted_layers": chosen}
            worker = self._worker
            worker.receiver_cls = type("LayerCorrupting", (worker.receiver_cls,), corrupting)
            worker.push_receiver_cls = type(
                "PushLayerCorrupting", (worker.push_receiver_cls,), corrupting
            )
        super().register_kv_caches(kv_caches)

    # -- P's digests: the scheduler names the blocks, each worker hashes its own ----------

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        self._note_leased(request, list(block_ids), delay)
        return delay, params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        self._note_leased(request, list(block_ids[0]), delay)
        return delay, params

    def _note_leased(self, request: Any, block_ids: list[int], leased: bool) -> None:
        if self._digests and leased:
            block_size = self._vllm_config.cache_config.block_size
            prompt_blocks = -(-request.num_prompt_tokens // block_size)
            self._finished_blocks[request.request_id] = block_ids[:prompt_blocks]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        metadata = super().build_connector_meta(scheduler_output)
        # Leased blocks: the next forward cannot overwrite them before the workers hash.
        metadata.test_digest_blocks, self._finished_blocks = self._finished_blocks, {}
        return metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        blocks = getattr(self._get_connector_metadata(), "test_digest_blocks", {})
        if not blocks or self._worker is None:
            return
        worker = self._worker
        # Blocks to digest mean a forward ran, and so the KV was registered.
        assert worker._layout is not None
        views = worker._layout.views
        for request_id, block_ids in blocks.items():
            logger.warning(
                DIGEST_LOG,
                "prefill",
                request_id,
                worker._tp_rank,
                len(block_ids),
                digest(views, block_ids),
            )
