"""Push mode's status question (D -> P) and P's answer: what survives the wire, and what each
side refuses, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.push.status import (
    MAX_ASKED,
    MAX_REASON_CHARS,
    GaveUp,
    PushStatusQuery,
    answer,
    gave_up_in,
)

request_ids = st.text(min_size=1, max_size=80)


@given(st.integers(0, 2**63 - 1), st.lists(request_ids, max_size=30, unique=True))
def test_a_question_survives_the_wire(cluster_id: int, requests: list[str]) -> None:
    query = PushStatusQuery(cluster_id, tuple(requests))
    assert PushStatusQuery.from_dict(query.to_dict()) == query


@given(
    st.dictionaries(request_ids, st.builds(GaveUp, st.text(max_size=200), st.booleans())),
    st.lists(request_ids, max_size=10),
)
def test_an_answer_survives_the_wire(gave_up: dict[str, GaveUp], others: list[str]) -> None:
    asked = [*gave_up, *others]
    assert gave_up_in(answer(gave_up), asked) == gave_up


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ([1], "must be a dict"),
        ({"cluster_id": 1, "requests": "r"}, "'requests' must list"),
        ({"cluster_id": 1, "requests": ["r"] * (MAX_ASKED + 1)}, "'requests' must list"),
        ({"cluster_id": 1, "requests": [7]}, "request ids must be strings"),
        ({"cluster_id": 1, "requests": ["x" * 1025]}, "request ids must be strings"),
        ({"cluster_id": -1, "requests": []}, "cluster_id"),
        ({"cluster_id": "1", "requests": []}, "cluster_id"),
        ({"requests": []}, "cluster_id"),
    ],
)
def test_hostile_questions_are_refused_naming_the_field(message: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PushStatusQuery.from_dict(message)


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        ({}, "must carry a dict 'gave_up'"),
        ({"gave_up": [["r", "why", True]]}, "must carry a dict 'gave_up'"),
        ({"gave_up": {"other": ["why", False]}}, "was not asked about"),
        ({"gave_up": {"r": "why"}}, r"must be \[reason, relink\]"),
        ({"gave_up": {"r": ["why", 1]}}, r"must be \[reason, relink\]"),
        ({"gave_up": {"r": [3, False]}}, r"must be \[reason, relink\]"),
        ({"gave_up": {"r": ["why", False, 1]}}, r"must be \[reason, relink\]"),
    ],
)
def test_hostile_answers_are_refused(reply: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        gave_up_in(reply, ["r"])


def test_a_long_reason_is_cut() -> None:
    reply = answer({"r": GaveUp("x" * 10_000, True)})
    assert gave_up_in(reply, ["r"]) == {"r": GaveUp("x" * MAX_REASON_CHARS, True)}
