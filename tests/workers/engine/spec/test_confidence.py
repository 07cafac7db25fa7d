"""The acceptance calibrator learns true acceptance rates from accept/reject outcomes, stays monotone
in the drafter's probability, holds fixed memory, follows drift, and refuses bad input by name."""

import pytest
import torch

from workers.engine.spec.confidence import NO_DRAFT, AcceptanceCalibrator, expected_accepted_prefix

K = 3


def verify_step(raw: torch.Tensor, true_rate, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft verified; each accepted with probability true_rate(raw) independently, so a row
    accepts up to its first rejection."""
    accepted_each = torch.rand(raw.shape, generator=generator) < true_rate(raw)
    accepted = accepted_each.int().cumprod(1).sum(1)
    return torch.full((raw.shape[0],), raw.shape[1]), accepted


def train(calibrator: AcceptanceCalibrator, steps: int, true_rate, generator: torch.Generator, rows: int = 64) -> None:
    for _ in range(steps):
        raw = torch.rand(rows, K, generator=generator)
        calibrator.observe(raw, *verify_step(raw, true_rate, generator))


def grid() -> torch.Tensor:
    return torch.linspace(0.05, 0.95, 19)[:, None].expand(19, K).contiguous()


def pav(values: list[float], weights: list[float]) -> list[float]:
    """Reference weighted isotonic regression: pool adjacent violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight_b, count = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + weight_b
            blocks[-1] = [(previous[0] * previous[1] + mean * weight_b) / total, total, previous[2] + count]
    return [mean for mean, _, count in blocks for _ in range(count)]


def test_an_unseen_drafter_is_trusted_as_it_is():
    calibrator = AcceptanceCalibrator(K)

    calibrated = calibrator.calibrate(grid())

    torch.testing.assert_close(calibrated, grid(), atol=1e-6, rtol=0)


def test_converges_to_the_true_acceptance_rate_at_every_position():
    calibrator = AcceptanceCalibrator(K)

    train(calibrator, 1500, lambda raw: raw**2, torch.Generator().manual_seed(0))

    calibrated = calibrator.calibrate(grid())
    assert (calibrated - grid() ** 2).abs().max() < 0.06
    # Far from what the drafter said: it really learnt.
    assert (grid() - grid() ** 2).abs().max() > 0.2


def test_the_map_is_monotone_even_when_acceptance_is_not():
    calibrator = AcceptanceCalibrator(K)

    # Acceptance falls as the drafter grows surer: the monotone fit pools it flat.
    train(calibrator, 300, lambda raw: 1.0 - raw, torch.Generator().manual_seed(1))

    assert (calibrator.table.diff(dim=1) >= 0).all()
    calibrated = calibrator.calibrate(torch.linspace(0, 1, 101)[:, None].expand(101, K).contiguous())
    assert (calibrated.diff(dim=0) >= 0).all()


def test_the_fit_is_the_weighted_isotonic_regression_of_the_bin_rates():
    bins, prior = 10, 2.0
    calibrator = AcceptanceCalibrator(1, bins=bins, prior_strength=prior, half_life=1e12)
    generator = torch.Generator().manual_seed(2)
    raws, accepted = [], []
    for b in range(bins):
        count = int(torch.randint(0, 12, (1,), generator=generator))
        raws += [(b + 0.5) / bins] * count
        accepted += torch.randint(0, 2, (count,), generator=generator).tolist()
    raw = torch.tensor(raws)[:, None]

    calibrator.observe(raw, torch.ones(len(raws), dtype=torch.long), torch.tensor(accepted))

    centres = [(b + 0.5) / bins for b in range(bins)]
    seen = [sum(1 for r in raws if abs(r - c) < 1e-9) for c in centres]
    hits = [sum(a for r, a in zip(raws, accepted) if abs(r - c) < 1e-9) for c in centres]
    rates = [(h + prior * c) / (n + prior) for h, n, c in zip(hits, seen, centres)]
    expected = pav(rates, [n + prior for n in seen])
    assert max(rates[i] > rates[i + 1] for i in range(bins - 1))  # the data did need pooling
    torch.testing.assert_close(calibrator.table[0], torch.tensor(expected), atol=1e-5, rtol=0)


def test_memory_is_fixed_however_long_it_runs():
    calibrator = AcceptanceCalibrator(K)
    generator = torch.Generator().manual_seed(3)
    train(calibrator, 5, lambda raw: raw, generator)
    sizes = {name: tuple(value.shape) for name, value in vars(calibrator).items() if isinstance(value, torch.Tensor)}

    train(calibrator, 500, lambda raw: raw, generator, rows=200)

    assert {
        name: tuple(value.shape) for name, value in vars(calibrator).items() if isinstance(value, torch.Tensor)
    } == sizes
    assert all(not isinstance(value, list | dict | set) for value in vars(calibrator).values())


def test_calibration_error_falls_as_it_learns():
    calibrator = AcceptanceCalibrator(K, half_life=2048)
    generator = torch.Generator().manual_seed(4)
    train(calibrator, 10, lambda raw: raw**2, generator)
    early = calibrator.calibration_error()

    train(calibrator, 1500, lambda raw: raw**2, generator)
    late = calibrator.calibration_error()

    assert late.overall < early.overall / 3
    assert late.overall < 0.03 and all(error < 0.05 for error in late.per_position)
    # The drafter's own probability stays as wrong as it was: |raw - raw^2| averages about 0.17.
    assert late.raw_overall > 0.12
    assert len(late.per_position) == K and late.outcomes > 0


def test_it_follows_a_drift_in_acceptance():
    calibrator = AcceptanceCalibrator(K, half_life=512)
    generator = torch.Generator().manual_seed(5)
    train(calibrator, 600, lambda raw: raw**2, generator)

    train(calibrator, 1200, lambda raw: raw.sqrt(), generator)

    calibrated = calibrator.calibrate(grid())[:, 0]
    assert (calibrated - grid()[:, 0].sqrt()).abs().max() < 0.08


def test_unverified_drafts_and_drafts_after_a_rejection_teach_nothing():
    calibrator = AcceptanceCalibrator(K, half_life=1e12)
    raw = torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])

    # Row 0 verified one draft and accepted it; row 1 verified all three and rejected the first.
    calibrator.observe(raw, torch.tensor([1, 3]), torch.tensor([1, 0]))

    assert calibrator.calibration_error().outcomes == pytest.approx(2.0)
    untouched = AcceptanceCalibrator(K).table
    torch.testing.assert_close(calibrator.table[1:], untouched[1:])
    assert not torch.equal(calibrator.table[0], untouched[0])


def test_rows_may_hold_fewer_positions_than_the_most_drafts():
    calibrator = AcceptanceCalibrator(K, half_life=1e12)
    raw = torch.tensor([[0.9, 0.9]])

    calibrator.observe(raw, torch.tensor([2]), torch.tensor([2]))

    assert calibrator.calibrate(raw).shape == (1, 2)
    assert calibrator.calibration_error().outcomes == pytest.approx(2.0)
    torch.testing.assert_close(calibrator.table[2], AcceptanceCalibrator(K).table[2])


def test_missing_drafts_stay_missing():
    calibrator = AcceptanceCalibrator(K)
    raw = torch.tensor([[0.8, NO_DRAFT, NO_DRAFT], [0.5, 0.4, 0.3]])

    calibrated = calibrator.calibrate(raw)
    calibrator.observe(raw, torch.tensor([3, 3]), torch.tensor([3, 3]))

    assert calibrated[0, 1:].tolist() == [NO_DRAFT, NO_DRAFT]
    assert calibrator.calibration_error().outcomes == pytest.approx(4.0)


def test_the_expected_accepted_prefix_is_the_cumulative_product_cut_at_a_missing_draft():
    calibrated = torch.tensor([[0.9, 0.5, 1.0], [0.5, NO_DRAFT, 0.7], [0.0, 0.3, 0.2]])

    prefix = expected_accepted_prefix(calibrated)

    torch.testing.assert_close(prefix, torch.tensor([[0.9, 0.45, 0.45], [0.5, NO_DRAFT, NO_DRAFT], [0.0, 0.0, 0.0]]))


def test_the_expected_prefix_never_grows_along_a_row():
    calibrated = torch.rand(200, 8, generator=torch.Generator().manual_seed(6)) ** 0.1

    prefix = expected_accepted_prefix(calibrated)

    assert (prefix.diff(dim=1) <= 0).all()


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: AcceptanceCalibrator(-1), "max_draft_tokens"),
        (lambda: AcceptanceCalibrator(K, bins=1), "bins"),
        (lambda: AcceptanceCalibrator(K, prior_strength=0), "prior_strength"),
        (lambda: AcceptanceCalibrator(K, half_life=float("inf")), "half_life"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.tensor([[0.5, 1.5, 0.2]])), "raw probabilities"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.tensor([[0.5, -0.5, 0.2]])), "raw probabilities"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.tensor([[float("nan")]])), "raw probabilities"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.rand(4)), "raw must be"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.rand(4, K + 1)), "max_draft_tokens"),
        (lambda: AcceptanceCalibrator(K).calibrate(torch.ones(4, K, dtype=torch.long)), "raw must hold"),
        (
            lambda: AcceptanceCalibrator(K).observe(
                torch.rand(4, K), torch.full((3,), K), torch.zeros(4, dtype=torch.long)
            ),
            "verified must have shape",
        ),
        (
            lambda: AcceptanceCalibrator(K).observe(torch.rand(4, K), torch.full((4,), K), torch.zeros(4)),
            "accepted must be an integer",
        ),
        (
            lambda: AcceptanceCalibrator(K).observe(torch.rand(2, K), torch.tensor([1, 4]), torch.tensor([0, 0])),
            "verified counts",
        ),
        (
            lambda: AcceptanceCalibrator(K).observe(torch.rand(2, K), torch.tensor([1, 2]), torch.tensor([2, 0])),
            "accepted counts",
        ),
        (lambda: expected_accepted_prefix(torch.rand(3)), "calibrated must be"),
    ],
)
def test_bad_input_is_refused_by_name(call, names):
    with pytest.raises(ValueError, match=names):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_hot_path_never_syncs_with_the_host():
    calibrator = AcceptanceCalibrator(K, device="cuda")
    raw = torch.rand(16, K, device="cuda")
    verified = torch.full((16,), K, device="cuda")
    accepted = torch.randint(0, K + 1, (16,), device="cuda")
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        calibrator.observe(raw, verified, accepted)
        expected_accepted_prefix(calibrator.calibrate(raw))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_outcomes_scored_with_the_calibration_a_plan_computed_learn_as_scoring_them_anew():
    # The planner passes the calibrated matrix its plan computed: the same estimate observe would
    # compute, so the map and the reported error come out the same.
    given, anew = AcceptanceCalibrator(K), AcceptanceCalibrator(K)
    generator = torch.Generator().manual_seed(9)
    for _ in range(50):
        raw = torch.rand(16, K, generator=generator)
        verified, accepted = verify_step(raw, lambda r: r**2, generator)
        given.observe(raw, verified, accepted, calibrated=given.calibrate(raw))
        anew.observe(raw, verified, accepted)

    assert torch.equal(given.table, anew.table)
    assert given.calibration_error() == anew.calibration_error()
