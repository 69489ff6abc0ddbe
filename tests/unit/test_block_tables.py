"""P's scheduler follows the block tables of its remote-decode prompts from the scheduler
output alone, as vLLM's model runner does; and knows which blocks a sliding window leaves
behind once a prompt is computed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector.mapping.kv_groups import blocks_left_behind, group_windows
from hixl_connector.connector.scheduler.block_tables import BlockTables


def output(new: dict[str, list[list[int]]], cached: dict[str, Any], resumed: set[str]) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), new_block_ids=list(cached.values()), resumed_req_ids=resumed
        ),
    )


def test_a_table_is_set_when_new_extended_while_running_and_set_anew_when_resumed() -> None:
    tables = BlockTables()
    tables.follow("p")
    tables.update(output({"p": [[1, 2], [7]], "other": [[9]]}, {}, set()))
    assert tables["p"] == ((1, 2), (7,)) and "other" not in tables
    tables.update(output({}, {"p": ([3], []), "other": ([4],)}, set()))
    assert tables["p"] == ((1, 2, 3), (7,))
    tables.update(output({}, {"p": None}, set()))  # scheduled, nothing allocated
    assert tables["p"] == ((1, 2, 3), (7,))
    tables.update(output({}, {"p": ([5, 6], [8])}, {"p"}))  # preempted, then resumed
    assert tables["p"] == ((5, 6), (8,))
    tables.forget("p")
    assert "p" not in tables


def test_older_vllm_names_resumed_requests_by_flag() -> None:
    tables = BlockTables()
    tables.follow("p")
    cached = SimpleNamespace(req_ids=["p"], new_block_ids=[([4],)], resumed_from_preemption=[True])
    tables.update(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached))
    assert tables["p"] == ((4,),)


@given(st.integers(1, 4096), st.integers(1, 2048), st.sampled_from([1, 16, 32, 64]))
def test_the_blocks_left_behind_hold_no_token_the_last_prompt_token_attends(
    prompt: int, window: int, block_size: int
) -> None:
    behind = blocks_left_behind(prompt, window, block_size)
    # D computes the prompt's last token again: it attends to tokens prompt - window on.
    first_attended = max(0, prompt - window)
    assert behind * block_size <= first_attended < (behind + 1) * block_size
    assert 0 <= behind <= -(-prompt // block_size)
    assert blocks_left_behind(prompt, 0, block_size) == 0  # full attention keeps all


def test_only_a_sliding_window_group_leaves_blocks_behind() -> None:
    class FullAttentionSpec:
        sliding_window = 512  # the hybrid manager off: a window layer keeps every block

    class SlidingWindowSpec:
        sliding_window = 512

    groups = [
        SimpleNamespace(kv_cache_spec=spec()) for spec in (FullAttentionSpec, SlidingWindowSpec)
    ]
    assert group_windows(SimpleNamespace(kv_cache_groups=groups)) == (0, 512)
    assert group_windows(None) == ()
