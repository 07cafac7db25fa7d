"""Random weights for fp8 layers (layers.fp8_linear.Fp8Linear, RoutedExperts in fp8): drawn in bounded
chunks and quantized into place, so no float copy of a whole weight is ever held (models'
`init_random_weights` calls it for each e4m3 parameter)."""

import math
from collections.abc import Iterator

import torch

from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.layers.moe import RoutedExperts

# An fp8 weight whose float32 draw is larger is drawn and quantized in chunks of about this many bytes,
# so that drawing random weights holds no float copy of a whole one. No tiny test model reaches it.
RANDOM_CHUNK_BYTES = 256 << 20
# CPU's randn fills 16 values at a time: chunks of a multiple of 16 values draw what one call would.
RANDN_GROUP = 16


def init_random_fp8(
    module: Fp8Linear | RoutedExperts, name: str, generator: torch.Generator, std: float, dtype: torch.dtype
) -> None:
    """Normal(0, std) values for `module`'s e4m3 weight `name`, rounded to `dtype` and quantized: the
    values the unquantized model (in `dtype`) holds for it, drawn by the same calls on `generator`
    where its float32 draw is at most RANDOM_CHUNK_BYTES. A larger one is drawn in chunks of rows
    (of experts for experts), which on the CPU draw the same values and on CUDA other ones (its
    randn spreads a call's values over threads by the call's size), still the same for a seed."""
    weight = getattr(module, name)
    rows, *row_shape = weight.shape
    # Fp8Linear's chunks end on tiles (block_n rows), so each quantizes on its own.
    align = module.block[0] if isinstance(module, Fp8Linear) else 1
    for first, count in _row_chunks(rows, math.prod(row_shape), align):
        values = torch.randn((count, *row_shape), generator=generator, device=weight.device)
        part = (values * std).to(dtype)
        if isinstance(module, Fp8Linear):
            module.load_rows(first, part, f"random rows {first}..{first + count} of {name}")
        else:
            module.load_experts(name, first, part)


def _row_chunks(rows: int, row_numel: int, align: int) -> Iterator[tuple[int, int]]:
    """(first row, rows) of each chunk a weight of `rows` rows of `row_numel` values is drawn in."""
    row_bytes = row_numel * torch.float32.itemsize
    if rows * row_bytes <= RANDOM_CHUNK_BYTES:
        yield 0, rows
        return
    step = math.lcm(align, RANDN_GROUP // math.gcd(row_numel, RANDN_GROUP))
    count = max(step, RANDOM_CHUNK_BYTES // row_bytes // step * step)
    for first in range(0, rows, count):
        yield first, min(count, rows - first)
