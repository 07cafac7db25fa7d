"""lb_sim's image mix: the encoder policies' choices, the encoder pool's batches, the mix's tiles as
the gateway counts them, and a quick seeded run whose JSON has every policy, where fewest patches
in flight is no worse than round-robin on the skewed mix (a deterministic simulation, not a timing)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lb_sim_images import (
    PATCHES_PER_TILE,
    EncoderCost,
    FewestPatches,
    ImageRequest,
    LeastRequestsEncoders,
    RoundRobinEncoders,
    draw_requests,
    simulate_encode,
)
from workers.cost_model import PrefillCostModel

REPO_ROOT = Path(__file__).resolve().parents[2]
# A GPU-like prefill (10 ms a step, 5 µs a token), so that encoding and prefill are of one scale.
MODEL = PrefillCostModel(a=0.01, b=5e-6, d=0.0, e=1e-10)
POLICIES = ["fewest_patches", "round_robin", "least_requests"]


def lb_sim(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "cost_model.json"
    MODEL.save(path)
    command = [sys.executable, "-m", "bench.lb_sim", "--image-mix", "--cost-model", str(path), *extra]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    completed = lb_sim(tmp_path_factory.mktemp("lb_images"), "--quick", "--encoders", "3", "--seed", "0")
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_quick_run_reports_every_encoder_policy_against_round_robin(quick_result):
    assert quick_result["mix"] == "image" and quick_result["requests"] == 300
    assert 0 < quick_result["image_requests"] < 300  # text requests are in the mix too
    assert [row["policy"] for row in quick_result["encode"]] == POLICIES
    for row in quick_result["encode"]:
        assert 0 < row["image_ttft_p50_s"] <= row["image_ttft_p99_s"]
        assert 0 <= row["encode_wait_p99_s"] <= row["encoded_p99_s"] <= row["image_ttft_p99_s"]
        assert row["encoder_imbalance_max_over_mean"] >= 1.0
        assert 0 < row["encoder_utilization"] <= 1.0 and 0 < row["prefill_utilization"] <= 1.0
    ratios = quick_result["ratios"]["image_ttft_p99_over_round_robin"]
    assert set(ratios) == set(POLICIES) and ratios["round_robin"] == 1.0


def test_fewest_patches_is_not_worse_than_round_robin_on_the_skewed_mix(quick_result):
    rows = {row["policy"]: row for row in quick_result["encode"]}
    assert rows["fewest_patches"]["image_ttft_p99_s"] <= rows["round_robin"]["image_ttft_p99_s"]
    assert rows["fewest_patches"]["encode_wait_p99_s"] <= rows["round_robin"]["encode_wait_p99_s"]


def test_a_prefill_pool_too_small_for_the_load_is_refused_by_name(tmp_path):
    completed = lb_sim(tmp_path, "--quick", "--prefill-workers", "1", "--encoders", "64")
    assert completed.returncode == 2 and "--prefill-workers" in completed.stderr


@pytest.mark.parametrize(
    "flag", [["--encoders", "0"], ["--encoder-utilization", "1.0"], ["--encoder-patches-per-s", "0"]]
)
def test_bad_image_mix_flags_are_refused(tmp_path, flag):
    completed = lb_sim(tmp_path, "--quick", *flag)
    assert completed.returncode == 2 and "error:" in completed.stderr


def test_the_policies_count_patches_and_requests_in_flight():
    fewest, least, rotating = FewestPatches(2), LeastRequestsEncoders(2), RoundRobinEncoders(2)
    for policy in (fewest, least, rotating):
        assert policy.choose(10 * PATCHES_PER_TILE) == 0

    # Encoder 0 holds one big request: fewest patches sends three small ones to encoder 1, least
    # requests alternates by count, round-robin by turn.
    assert [fewest.choose(PATCHES_PER_TILE) for _ in range(3)] == [1, 1, 1]
    assert [least.choose(PATCHES_PER_TILE) for _ in range(3)] == [1, 0, 1]
    assert [rotating.choose(PATCHES_PER_TILE) for _ in range(3)] == [1, 0, 1]
    fewest.on_done(0, 10 * PATCHES_PER_TILE)
    assert fewest.patches == [0, 3 * PATCHES_PER_TILE] and fewest.requests == [0, 3]
    assert fewest.choose(PATCHES_PER_TILE) == 0


def test_the_mix_counts_tiles_as_the_gateway_does():
    requests = draw_requests(400, seed=5)
    imaged = [r for r in requests if r.images]
    assert 0 < len(imaged) < len(requests)
    for r in imaged:
        tiles = r.patches // PATCHES_PER_TILE
        assert r.patches % PATCHES_PER_TILE == 0
        # SmolVLM's split: 4 tiles on the longest edge, 1 to 4 on the other, and the global tile.
        assert 5 * r.images <= tiles <= 17 * r.images
        assert r.image_tokens >= tiles * 81
    assert all(r.patches == r.image_tokens == 0 for r in requests if not r.images)
    assert draw_requests(50, seed=5) == requests[:50]  # the seed fixes the mix


def test_an_encoder_batches_whole_requests_within_its_patch_budget():
    cost = EncoderCost(patches_per_s=1000.0, batch_overhead_s=0.5, batch_patches=300)
    first = ImageRequest(0.0, 10, 1, 100, 0)
    queued = [ImageRequest(0.1, 10, 1, patches, 0) for patches in (100, 150, 200)]
    requests = [first, *queued, ImageRequest(0.1, 10, 0, 0, 0)]

    run = simulate_encode(requests, FewestPatches(1), 1, cost, lambda: 1.0)

    # An idle encoder starts at once; the two that queued meanwhile fit one batch (250 patches), the
    # third waits for the next; a text request needs no encoder.
    assert run.ready_s[0] == pytest.approx(0.5 + 0.1)
    assert run.ready_s[1] == run.ready_s[2] == pytest.approx(0.6 + 0.5 + 0.25)
    assert run.ready_s[3] == pytest.approx(1.35 + 0.5 + 0.2)
    assert run.ready_s[4] == 0.1
    assert run.wait_s == pytest.approx([0.0, 0.5, 0.5, 1.25])
