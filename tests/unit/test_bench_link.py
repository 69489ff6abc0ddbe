"""bench-link's arithmetic: the link rate it is given, and the KV a model caches per token,
read from the model it builds (the figure's "layers of transfer" rest on both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hixl_connector.tools.bench_link import KVShape, Samples, rate_bits
from hixl_connector.tools.demo.tiny_model import build_tiny_model


@pytest.mark.parametrize(
    ("rate", "bits"), [("1gbit", 1e9), ("250mbit", 250e6), ("640kbit", 640e3), ("1.5Gbit", 1.5e9)]
)
def test_rates_as_tc_spells_them(rate: str, bits: float) -> None:
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1gbps", "fast", "", "-1mbit", "1 gbit"])
def test_other_rates_are_refused(rate: str) -> None:
    with pytest.raises(ValueError, match="--rate"):
        rate_bits(rate)


def test_the_wide_model_caches_32_kib_a_token_in_8_layers(tmp_path: Path) -> None:
    kv = KVShape.of(build_tiny_model(tmp_path / "wide", "llama-wide"))
    assert kv == KVShape(layers=8, bytes_per_token=32 * 1024)


def test_the_exposed_transfer_is_the_median_of_ttft_less_prefill() -> None:
    samples = Samples(ttft_s=[3.0, 2.5, 9.0], prefill_s=[2.0, 2.4, 1.0])
    assert samples.exposed_s == pytest.approx(1.0)
