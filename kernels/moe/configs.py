"""Which path and tile sizes the fused MoE op uses, by how many (token, choice) pairs it routes.

One table, read top to bottom, the first row whose bound the call does not exceed:

- Up to DIRECT_MAX_PAIRS pairs (32 tokens of top-8): the direct path (direct.py), with
  no sort and no padding. Decode at small batch is bound by streaming the chosen experts' weights
  (at 1 token of Qwen3-30B-A3B, 8 experts x 9.4 MB) and by launches; the aligned path's sort is
  ~30 small torch launches, several times the weights' streaming time. Each slot's pairs (<= 8 at
  a few tokens; more take further tiles) fill one BLOCK_M = 16 tile, the smallest tl.dot takes.
  With 8 slots live, narrow column blocks give enough CTAs to stream from every SM: gate-up
  768 / 32 = 24 blocks x 8 slots = 192 CTAs, down 2048 / 64 = 32 x 8 = 256 CTAs on the H100's 132
  SMs. Deep K blocks (128) and 4 stages keep ~20 KB of weights in flight per stage; two CTAs fit an
  SM's shared memory.
  The bound also caps the slot scan every program runs (a [16, pairs] selection). On the H100
  (bench.moe_layer, Qwen3-30B-A3B's experts, graph replay) the direct path reaches 61 / 74 / 85 / 90 /
  96 / 97% of the roofline at 1 / 2 / 4 / 8 / 16 / 32 tokens, the aligned one 24 / 37 / 53 / 66 / 76 /
  79%: it wins up to 256 pairs, the most that run measured.
- Beyond it, the aligned path (fused.py), by mean pairs per slot (T * k / S): small tiles for
  decode, larger for prefill (first guesses for the H200, to be tuned with bench.moe_layer).

The sizes assume 2-byte elements; float32 halves BLOCK_K so the pipelined tiles still fit in shared
memory (`block_k_for`). FP8 experts take their block_k (one activation group per K step) instead;
the table was tuned for bf16 weights and is a first guess for 1-byte ones.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int
    block_n: int  # the down GEMM's column block; also the gate-up GEMM's unless gate_up_block_n is set
    block_k: int
    num_warps: int
    num_stages: int
    direct: bool = False  # the direct path (no sort, no padding) rather than the aligned one
    gate_up_block_n: int | None = None

    @property
    def gate_up_columns(self) -> int:
        return self.gate_up_block_n or self.block_n


DIRECT_MAX_PAIRS = 256
DIRECT = TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, direct=True, gate_up_block_n=32)

# The aligned path's rows: (mean pairs per slot bound or None for the rest, config).
ALIGNED_CONFIGS = (
    (16, TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (48, TileConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (None, TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)


def tile_config(num_pairs: int, num_slots: int) -> TileConfig:
    if num_pairs <= DIRECT_MAX_PAIRS:
        return DIRECT
    return aligned_config(num_pairs, num_slots)


def aligned_config(num_pairs: int, num_slots: int) -> TileConfig:
    per_slot = num_pairs / num_slots
    return next(config for bound, config in ALIGNED_CONFIGS if bound is None or per_slot <= bound)


def block_k_for(config: TileConfig, element_size: int) -> int:
    return config.block_k * 2 // element_size
