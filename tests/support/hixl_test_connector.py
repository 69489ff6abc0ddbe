"""TEST ONLY: HixlConnector with the corrupted-KV control the tests need; never shipped.

vLLM loads it through ``kv_connector_module_path`` (``tests/support`` is on the tests'
PYTHONPATH). Its control travels in ``kv_connector_extra_config`` and is taken out before
HixlConnector validates the rest: with ``test_corrupt_received_kv``, D overwrites what it
received with noise before vLLM uses it, which must change the output. ``true`` corrupts
every layer; a string, only the layers whose names start with it (a speculative draft's,
say). Everything else is the production connector, reads included.
"""

from __future__ import annotations

from typing import Any

from hixl_connector.connector.facade import HixlConnector
from hixl_connector.connector.metadata import RecvSpec
from hixl_connector.connector.worker.receiver import Receiver

CONTROL = "test_corrupt_received_kv"
MODULE = "hixl_test_connector"


def with_controls(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a --kv-transfer-config) naming this connector when its extra config holds
    the control; unchanged otherwise."""
    if CONTROL not in config.get("kv_connector_extra_config", {}):
        return config
    return {**config, "kv_connector": "HixlTestConnector", "kv_connector_module_path": MODULE}


class CorruptingReceiver(Receiver):
    # The registered layers (in registration order) to corrupt; all if None.
    corrupted_layers: tuple[int, ...] | None = None

    def _received(self, spec: RecvSpec, nbytes: int, pull_s: float, ready_s: float) -> None:
        import torch

        index = torch.tensor(spec.local_block_ids, dtype=torch.long)
        chosen = self.corrupted_layers
        per_layer = self._layout.tensors_per_layer
        for i, view in enumerate(self._layout.views):
            if chosen is None or i // per_layer in chosen:
                noise = torch.randn(view[index].shape, dtype=torch.float32) * 5
                view[index] = noise.to(view.dtype)
        super()._received(spec, nbytes, pull_s, ready_s)


def layers_named(names: list[str], prefix: str) -> tuple[int, ...]:
    """The indices of the layers named ``prefix``...; refuses a prefix that names none, so a
    control that corrupts nothing cannot pass for one that does."""
    layers = tuple(i for i, name in enumerate(names) if name.startswith(prefix))
    if not layers:
        raise ValueError(f"{CONTROL}: no KV layer starts with {prefix!r}; layers: {names}")
    return layers


class HixlTestConnector(HixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        corrupt = extra.pop(CONTROL, False)
        if not isinstance(corrupt, (bool, str)) or corrupt == "":
            raise ValueError(f"{CONTROL} must be a bool or a layer-name prefix, got {corrupt!r}")
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            extra[CONTROL] = corrupt  # the other role's connector takes it too
        self._corrupt = corrupt
        if self._worker is not None and corrupt:
            self._worker.receiver_cls = CorruptingReceiver

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is not None and isinstance(self._corrupt, str):
            # The layout registers the layers in the order vLLM hands them over (no buffer
            # is shared without the hybrid manager, which this control is not used with).
            chosen = layers_named(list(kv_caches), self._corrupt)
            self._worker.receiver_cls = type(
                "LayerCorruptingReceiver", (CorruptingReceiver,), {"corrupted_layers": chosen}
            )
        super().register_kv_caches(kv_caches)
