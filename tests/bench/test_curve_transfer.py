"""bench.curve_transfer at a tiny size: both modes move a whole handoff (checked byte for byte by the
benchmark itself) and the report has every figure, plain and CURVE."""

from bench.curve_transfer import measure


def test_both_modes_deliver_and_every_figure_is_reported():
    report = measure(tokens=8, runs=1, num_round_trips=3)

    assert report["kv_bytes"] == 30 * 2 * 3 * 8 * 64 * 4
    for section, unit in (("transfer", "s"), ("round_trip", "us")):
        figures = report[section]
        assert figures[f"plain_{unit}"] > 0 and figures[f"curve_{unit}"] > 0
        assert figures["curve_over_plain"] == round(figures[f"curve_{unit}"] / figures[f"plain_{unit}"], 3)
    assert report["round_trips"] == 3
