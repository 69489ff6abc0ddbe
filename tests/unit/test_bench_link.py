"""bench-link's arithmetic: the link rate it is given, the KV a model caches per token read
from its config (the figure's "layers of transfer" rest on both), and the exposed transfer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hixl_connector.tools.bench_link import KVShape, Samples, rate_bits


@pytest.mark.parametrize(
    ("rate", "bits"), [("1gbit", 1e9), ("250mbit", 250e6), ("640kbit", 640e3), ("1.5Gbit", 1.5e9)]
)
def test_rates_as_tc_spells_them(rate: str, bits: float) -> None:
    assert rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1gbps", "fast", "", "-1mbit", "1 gbit", "0bit", "0.0gbit"])
def test_other_rates_are_refused(rate: str) -> None:
    with pytest.raises(ValueError, match="--rate"):
        rate_bits(rate)


@pytest.mark.parametrize(
    ("config", "shape"),
    [
        # llama-wide: 8 layers of 8 KV heads of 512 / 8, float32.
        (
            {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
             "num_key_value_heads": 8},
            KVShape(layers=8, bytes_per_token=32 * 1024),
        ),
        # An explicit head_dim wins over hidden_size / heads (GQA with wide heads).
        (
            {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64},
            KVShape(layers=2, bytes_per_token=2 * 2 * 2 * 64 * 4),
        ),
    ],
)  # fmt: skip
def test_kv_shape_from_the_models_config(
    tmp_path: Path, config: dict[str, int], shape: KVShape
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert KVShape.of(tmp_path) == shape


def test_the_exposed_transfer_is_the_median_of_each_requests_ttft_less_its_prefill() -> None:
    # Median of the differences (1.0, 0.1, 0.5) is 0.5; the difference of the medians
    # (3.0 - 2.4) would be 0.6.
    samples = Samples(ttft_s=[3.0, 2.5, 9.0], prefill_s=[2.0, 2.4, 8.5])
    assert samples.exposed_s == pytest.approx(0.5)
