import json
from pathlib import Path

import pytest

from bench.reuse_study import study


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    """Full blocks [1, 2, 3], [1, 2], [1, 2, 3, 5] at 0, 1 and 2 s (the first request's id 4 is partial)."""
    requests = [
        {"timestamp": 0, "input_length": 3 * 512 + 300, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 1000, "input_length": 2 * 512, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 4 * 512, "output_length": 1, "hash_ids": [1, 2, 3, 5]},
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    return path


def test_reuse_after_each_use(tiny_trace):
    result = study(tiny_trace, capacity_share=0.5)
    # Blocks 1 and 2 are used 3 times 1 s apart, block 3 twice 2 s apart, block 5 once; 4 never (partial).
    assert result["unique_blocks"] == 4
    assert result["after_use"] == {
        "1": {"p_another_use": 3 / 4, "median_gap_s": 1.0},
        "2": {"p_another_use": 2 / 3, "median_gap_s": 1.0},
        "3": {"p_another_use": 0.0, "median_gap_s": None},
    }


def test_an_lru_store_rewrites_what_it_evicted_and_splits_writes_by_chain(tiny_trace):
    # Given a store of 2 blocks: the first request's block 3 is evicted, the third request writes it again
    result = study(tiny_trace, capacity_share=0.5)["lru_store"]
    assert result["capacity_blocks"] == 2
    assert result["written_blocks"] == 5
    assert result["rewritten_share"] == 1 / 5
    assert result["turnover_s"] == 2 / (5 / 2.0)
    assert result["new_chain"] == {"blocks": 3, "p_used_again": 1.0}
    assert result["continuation"] == {"blocks": 2, "p_used_again": 0.0}


def test_bad_input_is_refused(tiny_trace, tmp_path):
    with pytest.raises(ValueError, match="capacity-share"):
        study(tiny_trace, capacity_share=0.0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no requests"):
        study(empty, capacity_share=0.05)
