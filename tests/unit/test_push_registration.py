"""Push mode's D -> P registration: what P accepts, and what it refuses naming the field."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.push.registration import (
    HeadRun,
    PushRegistration,
    Slices,
    StateRun,
)

ids = st.integers(0, 2**31)


@st.composite
def slices(draw: st.DrawFn) -> Slices:
    ratio = draw(st.integers(2, 64))
    run = st.builds(
        SliceRun,
        st.integers(0, ratio - 1),
        st.integers(0, 4096),
        st.integers(0, 4096),
        st.integers(1, 4096),
    )
    return Slices(ratio, tuple(draw(st.lists(run, min_size=1, max_size=20))))


head_run = st.builds(HeadRun, st.integers(0, 65536), st.integers(0, 65536), st.integers(1, 65536))


@st.composite
def registrations(draw: st.DrawFn) -> PushRegistration:
    blocks = draw(st.lists(ids, max_size=40))
    positions = draw(st.lists(ids, min_size=len(blocks), max_size=len(blocks)))
    sliced = draw(st.none() | slices())
    most = 1 if sliced is not None else 4
    # How many of the positions each KV-cache group holds (one group where sliced).
    cuts = sorted(draw(st.lists(st.integers(0, len(blocks)), max_size=0 if sliced else 3)))
    bounds = [0, *cuts, len(blocks)]
    groups = draw(st.just(()) | st.just(tuple(b - a for a, b in itertools.pairwise(bounds))))
    grants = draw(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=most))
    return PushRegistration(
        request=draw(st.text(min_size=1, max_size=60)),
        cluster_id=draw(st.integers(0, 2**63 - 1)),
        positions=tuple(positions),
        blocks=tuple(blocks),
        grants=tuple(grants),
        word=(draw(ids), draw(st.integers(0, 2**63 - 1))),
        wait_s=draw(st.floats(0.001, 3600)),
        slices=sliced,
        heads=tuple(draw(st.lists(head_run, max_size=4))),
        units_per_block=draw(st.integers(1, 65536)),
        rank=draw(st.integers(0, 65535)),
        consumers=draw(st.integers(1, 65535)),
        groups=groups,
        **draw(state_slots()),
    )


@st.composite
def state_slots(draw: st.DrawFn) -> dict[str, Any]:
    """A state model's slots, with their grant and token count, or none."""
    runs = draw(
        st.lists(
            st.builds(
                StateRun,
                st.integers(0, 63),
                st.integers(0, 2**48),
                st.integers(0, 2**48),
                st.integers(1, 2**48),
            ),
            max_size=4,
        )
    )
    if not runs:
        return {}
    return {
        "state_runs": tuple(runs),
        "state_grant": draw(st.integers(1, 2**63 - 1)),
        "num_tokens": draw(st.integers(1, 2**31)),
    }


@given(registrations())
def test_a_registration_survives_the_wire(registration: PushRegistration) -> None:
    assert PushRegistration.from_dict(registration.to_dict()) == registration


GOOD = PushRegistration("cmpl-x-0", 9, (0, 1), (5, 6), (11,), (3, 12), 30.0).to_dict()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"request": ""}, "request"),
        ({"request": "x" * 2000}, "longer than"),
        ({"cluster_id": -1}, "cluster_id"),
        ({"positions": [0]}, "1 positions for 2 blocks"),
        ({"blocks": [5, True]}, "blocks"),
        ({"blocks": "56"}, "blocks"),
        ({"grants": []}, "grants no cache"),
        ({"grants": [2**63]}, "grants"),
        ({"word": [3]}, "word must be"),
        ({"word": None}, "word"),
        ({"wait_s": 0}, "wait_s"),
        ({"wait_s": float("nan")}, "wait_s"),
        ({"wait_s": True}, "wait_s"),
        ({"wait_s": 1e12}, "wait_s"),
        ({"slices": 2}, "must be \\[ratio, runs\\]"),
        ({"slices": [1, [[0, 0, 0, 1]]]}, "slices ratio"),
        ({"slices": [2, []]}, "1 to 4096 runs"),
        ({"slices": [2, [[0, 0, 0, 1]] * 4097]}, "1 to 4096 runs"),
        ({"slices": [2, [[2, 0, 0, 1]]]}, "part < 2"),
        ({"slices": [2, [[0, 0, 0, 0]]]}, "count >= 1"),
        ({"slices": [2, [[0, 0, -1, 1]]]}, "slices run"),
        ({"slices": [2, [[0, 0, 1]]]}, "part < 2"),
        ({"slices": [2, [[0, 0, 0, 1]]], "grants": [1, 2]}, "grants 2 caches, in slices"),
        ({"heads": 3}, "'heads' must be a list"),
        ({"heads": [[0, 0, 0]], "units_per_block": 1}, "count >= 1"),
        ({"heads": [[0, 0]], "units_per_block": 1}, "count >= 1"),
        ({"heads": [[0, -1, 1]], "units_per_block": 1}, "heads run"),
        ({"heads": [[0, 0, 1]], "units_per_block": 0}, "no units_per_block"),
        ({"units_per_block": None}, "units_per_block"),
        ({"rank": -1}, "rank"),
        ({"rank": 65536}, "rank"),
        ({"consumers": 0}, "consumers"),
        ({"consumers": "2"}, "consumers"),
        ({"groups": [1]}, "splits 1 positions by KV-cache group, it has 2"),
        ({"groups": [1, 2]}, "splits 3 positions"),
        ({"groups": [2, -1, 1]}, "groups"),
        ({"groups": [0] * 65 + [2]}, "groups"),
        ({"groups": "2"}, "groups"),
        ({"groups": [1, 1], "slices": [2, [[0, 0, 0, 1]]]}, "2 KV-cache groups and slices"),
        ({"state_runs": 3}, "'state_runs' must be a list"),
        ({"state_runs": [[1, 0, 2, 1]] * 1025}, "'state_runs' must be a list"),
        ({"state_runs": [[1, 0, 2]]}, "must be \\[group < 64, src, dst, count >= 1\\]"),
        ({"state_runs": [[1, 0, 2, 0]]}, "count >= 1"),
        ({"state_runs": [[1, 0, -2, 1]]}, "state_runs"),
        ({"state_runs": [[1, 0, 2**48 + 1, 1]]}, "state_runs"),
        ({"state_runs": [1, 0, 2, 1]}, "state_runs"),
        ({"state_grant": -1}, "state_grant"),
        ({"state_grant": 2**63}, "state_grant"),
        ({"state_runs": [[64, 0, 2, 1]], "state_grant": 5, "num_tokens": 3}, "group < 64"),
        ({"state_runs": [[1, 0, 2, 1]], "num_tokens": 3}, "without a state_grant and num_tokens"),
        ({"state_runs": [[1, 0, 2, 1]], "state_grant": 5}, "without a state_grant and num_tokens"),
        ({"num_tokens": -1}, "num_tokens"),
    ],
)
def test_hostile_registrations_are_refused_naming_the_field(
    change: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        PushRegistration.from_dict({**GOOD, **change})


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="must be a dict"):
        PushRegistration.from_dict([1, 2])


def test_a_state_slot_alone_needs_no_cache_grant() -> None:
    """D holds the prompt's KV (a local prefix hit) and takes a state alone."""
    alone = {**GOOD, "positions": [], "blocks": [], "grants": [], "groups": [0, 0]}
    alone |= {"state_runs": [[1, 0, 64, 3]], "state_grant": 8, "num_tokens": 31}
    parsed = PushRegistration.from_dict(alone)
    assert parsed.state_runs == (StateRun(1, 0, 64, 3),)
    assert parsed.grants == () and parsed.num_tokens == 31
