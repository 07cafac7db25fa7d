"""bench.fit_cost_model on a tiny random-weight model: the prefill grid and, with --decode, decode
steps measured and fitted into the saved model."""

from bench import fit_cost_model
from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.cost_model import PrefillCostModel


def test_a_quick_fit_measures_decode_steps_and_saves_them_with_the_prefill_model(tmp_path):
    model, result = fit_cost_model.run(TINY_CONFIGS["llama"], "cpu", trials=1, quick=True, seed=0, decode=True)

    decode = result["decode"]
    grid = [(b, c) for b in fit_cost_model.QUICK_DECODE_BATCHES for c in fit_cost_model.QUICK_DECODE_CONTEXTS]
    mean_context = 2 + fit_cost_model.DECODE_STEPS // 2
    assert sorted((s["batch"], s["total_kv"] // s["batch"] - mean_context) for s in decode["samples"]) == sorted(grid)
    assert all(s["ms"] > 0 for s in decode["samples"])
    assert model.decode is not None and decode["coefficients"]["a"] == model.decode.a
    path = tmp_path / "model.json"
    model.save(path)
    assert PrefillCostModel.load(path).decode == model.decode


def test_without_decode_the_model_derives_decode_steps_from_the_prefill_fit():
    model, result = fit_cost_model.run(TINY_CONFIGS["llama"], "cpu", trials=1, quick=True, seed=0)
    assert result["decode"] is None and model.decode is None
