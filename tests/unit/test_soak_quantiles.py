"""The soak's latency percentiles: of the requests measured after the warm-up only, from two
scrapes of D's cumulative Prometheus histogram."""

from __future__ import annotations

import bisect
import math

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.tools.soak import KV_READY_METRIC, histogram_quantiles

BOUNDS = [0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.05, 1.0, float("inf")]
seconds = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)


def scrape(samples: list[float]) -> dict[str, float]:
    """What /metrics shows for these observations: cumulative counts per upper bound."""
    out = {}
    for bound in BOUNDS:
        le = "+Inf" if bound == float("inf") else repr(bound)
        key = f'{KV_READY_METRIC}{{engine="0",le="{le}",model_name="m"}}'
        out[key] = float(sum(1 for s in samples if s <= bound))
    out['vllm:hixl_kv_ready_seconds_count{engine="0"}'] = float(len(samples))
    return out


def bucket_of(value_s: float) -> tuple[float, float]:
    i = bisect.bisect_left(BOUNDS, value_s)
    return (BOUNDS[i - 1] if i else 0.0), BOUNDS[i]


@given(st.lists(seconds, max_size=40), st.lists(seconds, min_size=1, max_size=200))
def test_quantiles_are_of_the_measured_requests_only(
    warm_up: list[float], measured: list[float]
) -> None:
    before = scrape(warm_up)
    after = scrape(warm_up + measured)
    for q, got_ms in zip(
        (0.5, 0.99), histogram_quantiles(before, after, KV_READY_METRIC, (0.5, 0.99)), strict=True
    ):
        ordered = sorted(measured)
        true = ordered[math.ceil(q * len(ordered)) - 1]
        low, high = bucket_of(true)
        # Interpolation lands in the bucket of the true quantile (the last finite bound when
        # it is beyond every bucket).
        high = BOUNDS[-2] if high == float("inf") else high
        assert low * 1000 - 1e-9 <= got_ms <= high * 1000 + 1e-9, (q, true, got_ms)


def test_warm_up_outliers_do_not_count() -> None:
    warm_up = [0.9] * 50  # the first reads link P: slow
    measured = [0.0002] * 99 + [0.0004]
    p50, p99 = histogram_quantiles(
        scrape(warm_up), scrape(warm_up + measured), KV_READY_METRIC, (0.5, 0.99)
    )
    assert 0.1 <= p50 <= 0.25 and 0.1 <= p99 <= 0.25
    everything = histogram_quantiles({}, scrape(warm_up + measured), KV_READY_METRIC, (0.99,))
    assert everything[0] > 50  # the same histogram without the first scrape: the outliers


def test_no_request_measured_gives_zero() -> None:
    same = scrape([0.001, 0.002])
    assert histogram_quantiles(same, same, KV_READY_METRIC, (0.5, 0.99)) == [0.0, 0.0]
