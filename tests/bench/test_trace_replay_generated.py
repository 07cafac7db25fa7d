import pytest

from bench.trace_replay_generated import TRACES, compare, summarize


def capacity(share: float, rates: dict[str, float]) -> dict:
    return {"share": share, "policies": {name: {"hit_rate": rate} for name, rate in rates.items()}}


def test_summary_counts_the_pairs_where_best_beats_the_best_classic():
    results = {
        "a": {"capacities": [capacity(0.05, {"lru": 0.2, "slru": 0.25, "best": 0.3})]},
        "b": {"capacities": [capacity(0.05, {"lru": 0.4, "slru": 0.3, "best": 0.4})]},
    }
    summary = summarize(results, ["lru", "slru", "best"])
    assert summary["best_beats_every_classic"] == "1 of 2"
    assert summary["margins"]["a@0.05"] == {"best_minus_best_classic": pytest.approx(0.05), "best_classic": "slru"}
    assert summary["margins"]["b@0.05"] == {"best_minus_best_classic": 0.0, "best_classic": "lru"}
    assert summarize(results, ["lru", "slru"]) == {}


def test_unknown_traces_are_refused():
    assert "chat-0" in TRACES and "api-1" in TRACES
    with pytest.raises(ValueError, match="unknown traces \\['nope'\\]"):
        compare(["chat-0", "nope"], ["lru"], [0.05])
