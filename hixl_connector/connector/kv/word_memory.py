"""Words in the memory the KV lives in (``leases.guarded_read.WordStore``): P's lease words,
D's scratch rows and push words, allocated on the KV's own device so that every buffer a
transfer touches is of the KV's memory kind (device memory on an NPU, host memory on a CPU).

Only the allocator and the copies differ by platform. Host words are read and written in
place. Device words are written by a device operation and read by a copy to the host, each
followed by a synchronisation of the device, so a write has landed in device memory when it
returns and a read sees every transfer the engine completed before it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# HCCS reads device memory only from 2 MB-aligned bases; every word store starts on one.
ALIGNMENT_BYTES = 2 * 1024 * 1024
_SIGN = 1 << 63


def aligned_zeros(count: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``count`` zeroed elements on ``device`` whose base is 2 MB aligned: a view into a
    larger allocation, which it keeps alive."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(count + ALIGNMENT_BYTES // item, dtype=dtype, device=device)
    offset = (-raw.data_ptr() % ALIGNMENT_BYTES) // item
    return raw[offset : offset + count]


def _signed(word: int) -> int:
    """A 64-bit word as the int64 element that holds its bits."""
    return word - (1 << 64) if word >= _SIGN else word


class WordMemory:
    """``count`` 64-bit words, zeroed, on ``device``, starting 2 MB aligned."""

    def __init__(self, count: int, device: Any) -> None:
        if count < 1:
            raise ValueError(f"a word store needs at least one word, got {count}")
        self._device = torch.device(device)
        self.tensor = aligned_zeros(count, torch.int64, self._device)
        self._host = self.tensor.numpy().view(np.uint64) if self._device.type == "cpu" else None

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def on_host(self) -> bool:
        return self._host is not None

    def __len__(self) -> int:
        return int(self.tensor.numel())

    def read(self, start: int, count: int) -> list[int]:
        if self._host is not None:
            return [int(w) for w in self._host[start : start + count]]
        self._synchronize()  # every completed transfer, then the device's own work
        host = self.tensor[start : start + count].cpu().numpy().view(np.uint64)
        return [int(w) for w in host]

    def write(self, index: int, word: int) -> None:
        if self._host is not None:
            self._host[index] = word
            return
        self.tensor[index].fill_(_signed(word))
        self._synchronize()

    def zero(self, start: int, count: int) -> None:
        if self._host is not None:
            self._host[start : start + count] = 0
            return
        self.tensor[start : start + count].zero_()
        self._synchronize()

    def _synchronize(self) -> None:
        if self._device.type != "cpu":
            torch.accelerator.synchronize(self._device)
