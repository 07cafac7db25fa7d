import json
import math
import random
from dataclasses import replace

import pytest

from workers.client.routing.balancers.decode import DecodeBalancer, new_workers
from workers.cost_model import (
    DecodeCostModel,
    DecodeSample,
    PredictionErrorTracker,
    PrefillCostModel,
    StepSample,
    evaluate,
    fit,
    fit_decode,
)

TRUE = PrefillCostModel(a=0.05, b=0.002, d=3e-7, e=1e-6)


def synthetic_samples(model, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [
        StepSample(q=q, c=c, seconds=model.predict(q, c) * (1 + rng.uniform(-noise, noise)))
        for q in (1, 16, 64, 256, 512, 1024, 2048)
        for c in (0, 512, 2048, 6000)
    ]


def test_fit_recovers_known_coefficients():
    model, report = fit(synthetic_samples(TRUE))
    for name in ("a", "b", "d", "e"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert report.max_rel_error < 1e-9


def test_fit_with_noise_stays_close_and_reports_the_error():
    model, report = fit(synthetic_samples(TRUE, noise=0.05))
    assert model.b == pytest.approx(TRUE.b, rel=0.1)
    assert model.e == pytest.approx(TRUE.e, rel=0.2)
    assert 0 < report.median_rel_error <= report.p90_rel_error <= report.max_rel_error < 0.1
    held_back = evaluate(model, synthetic_samples(TRUE, noise=0.05, seed=1))
    assert held_back.max_rel_error < 0.15


def test_fit_keeps_coefficients_non_negative():
    # Times that fall with context would need e < 0: the fit pins it at zero instead.
    samples = [
        StepSample(q=q, c=c, seconds=0.01 + 0.001 * q - 1e-8 * q * c) for q in (8, 64, 256) for c in (0, 100, 400)
    ]
    model, _ = fit(samples)
    assert min(model.a, model.b, model.d, model.e) >= 0
    assert model.e == 0


def test_fit_rejects_too_few_or_bad_samples():
    with pytest.raises(ValueError, match="at least"):
        fit([StepSample(1, 0, 0.1)])
    with pytest.raises(ValueError, match="positive"):
        fit([StepSample(1, 0, 0.0)] * 4)


@pytest.mark.parametrize("c", [0, 100, 4000])
@pytest.mark.parametrize("budget", [0.06, 0.2, 1.0, 5.0])
def test_max_chunk_is_the_largest_fitting_chunk(budget, c):
    q = TRUE.max_chunk(budget, c, limit=100_000)
    assert TRUE.predict(q, c) <= budget
    assert TRUE.predict(q + 1, c) > budget


def test_max_chunk_never_returns_zero_and_respects_the_limit():
    assert TRUE.max_chunk(0.0, 5000, limit=512) == 1  # nothing fits: still one token of progress
    assert TRUE.max_chunk(1e9, 0, limit=512) == 512
    linear = PrefillCostModel(a=0.0, b=0.01, d=0.0, e=0.0)
    assert linear.max_chunk(1.0, 0, limit=1000) == 100
    with pytest.raises(ValueError):
        TRUE.max_chunk(1.0, 0, limit=0)


def test_predict_prefill_chunks_by_the_budget():
    flat = PrefillCostModel(a=0.05, b=0.002, d=0.0, e=0.0)
    budget = flat.predict(512, 0)
    assert flat.predict_prefill(1100, 0, budget, limit=2048) == pytest.approx(2 * budget + flat.predict(76, 0))
    assert flat.predict_prefill(1100, 0, budget, limit=256) == pytest.approx(
        4 * flat.predict(256, 0) + flat.predict(76, 0)
    )
    # With context, later chunks are smaller, so the same prompt takes more steps.
    assert TRUE.predict_prefill(1100, 0, budget, limit=2048) > 2 * budget
    assert TRUE.predict_prefill(1024, 1024, budget, limit=2048) == 0.0


def test_decode_step_is_a_batch_of_single_token_rows():
    assert TRUE.predict_decode_step(4, 1000) == pytest.approx(TRUE.a + 4 * (TRUE.b + TRUE.d) + 1000 * TRUE.e)
    assert TRUE.predict_decode_step(0, 0) == 0.0


def test_json_round_trip(tmp_path):
    path = tmp_path / "model.json"
    TRUE.save(path)
    assert PrefillCostModel.load(path) == TRUE
    with_decode = replace(TRUE, decode=DECODE)
    with_decode.save(path)
    assert PrefillCostModel.load(path) == with_decode


DECODE = DecodeCostModel(a=0.001, b=2e-6, e=3e-9)


def test_a_measured_decode_model_predicts_decode_steps_and_weighs_the_decode_balancer():
    model = replace(TRUE, decode=DECODE)
    assert model.predict_decode_step(4, 1000) == pytest.approx(DECODE.a + 4 * DECODE.b + 1000 * DECODE.e)
    assert model.predict(64, 100) == TRUE.predict(64, 100)  # prefill is unchanged
    workers = new_workers(["w"], kv_capacity=1000, max_requests=4)
    balancer = DecodeBalancer.from_cost_model(workers, model)
    assert (balancer.per_request_s, balancer.per_kv_token_s) == (DECODE.b, DECODE.e)
    derived = DecodeBalancer.from_cost_model(workers, TRUE)
    assert (derived.per_request_s, derived.per_kv_token_s) == (TRUE.b + TRUE.d, TRUE.e)


def test_fit_decode_recovers_known_coefficients_and_refuses_bad_samples():
    samples = [
        DecodeSample(batch=b, total_kv=b * c, seconds=DECODE.predict(b, b * c))
        for b in (1, 8, 64, 256)
        for c in (128, 1024, 4096)
    ]
    model, report = fit_decode(samples)
    for name in ("a", "b", "e"):
        assert getattr(model, name) == pytest.approx(getattr(DECODE, name), rel=1e-6)
    assert report.max_rel_error < 1e-9
    with pytest.raises(ValueError, match="at least 3"):
        fit_decode(samples[:2])
    with pytest.raises(ValueError, match="batch >= 1"):
        fit_decode([DecodeSample(0, 0, 1.0)] * 3)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"a": 1, "b": 1, "d": 1, "e": 1}', "version"),
        ('{"version": 2, "a": 1, "b": 1, "d": 1, "e": 1}', "version"),
        ('{"version": 1, "a": 1, "b": 1, "d": 1}', "lacks coefficients \\['e'\\]"),
        ('{"version": 1, "a": 1, "b": -1, "d": 1, "e": 1}', "'b' must be non-negative"),
        ('{"version": 1, "a": 1, "b": 1, "d": NaN, "e": 1}', "'d' must be a finite number"),
        ('{"version": 1, "a": "1", "b": 1, "d": 1, "e": 1}', "'a' must be a finite number"),
        ('{"version": 1, "a": 1, "b": 1, "d": 1, "e": 1, "decode": {"a": 1}}', "decode entry must hold"),
        ('{"version": 1, "a": 1, "b": 1, "d": 1, "e": 1, "decode": {"a": 1, "b": 1, "e": -1}}', "'e' must be non"),
    ],
)
def test_bad_files_fail_with_clear_errors(tmp_path, document, message):
    path = tmp_path / "model.json"
    path.write_text(document)
    with pytest.raises(ValueError, match=message) as error:
        PrefillCostModel.load(path)
    assert str(path) in str(error.value)


def test_prediction_error_tracker_reports_rolling_percentiles():
    tracker = PredictionErrorTracker(window=4)
    assert tracker.percentiles() == (0.0, 0.0)
    for predicted in (1.1, 0.9, 1.5, 1.0, 1.0):  # the first falls out of the window
        tracker.record(predicted, 1.0)
    p50, p90 = tracker.percentiles()
    assert p50 == pytest.approx(0.05)
    assert p90 == pytest.approx(0.38)  # linear interpolation over [0, 0, 0.1, 0.5]
    assert all(isinstance(value, float) and math.isfinite(value) for value in (p50, p90))
    json.dumps({"p50": p50, "p90": p90})  # heartbeat-ready
