"""How many rows a CPU matmul needs before its per-row results stop depending on the row count.

BLAS libraries pick a kernel by problem size; below some row count (MKL: 4 rows with
MKL_CBWR=AVX2,STRICT, which workers.engine sets; 12 without it; on AVX-512 CPUs, without STRICT, no
row count is enough) a row's dot products are summed in another order and round differently.
Padding every matmul to at least that many rows makes results batch-invariant. The threshold is
measured once per process on the running BLAS rather than assumed.
"""

import functools

import torch

CANDIDATES = (4, 8, 12, 16, 32)
PROBE_ROWS = 48


@functools.cache
def min_invariant_rows() -> int:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(320, 576, generator=generator)
    inputs = torch.randn(PROBE_ROWS, 576, generator=generator)
    reference = inputs @ weight.T
    batched_weight = weight.T.expand(3, -1, -1)
    batched_reference = torch.matmul(inputs.expand(3, -1, -1), batched_weight)
    for rows in CANDIDATES:
        if all(
            torch.equal(inputs[:m] @ weight.T, reference[:m])
            and torch.equal(torch.matmul(inputs[:m].expand(3, -1, -1), batched_weight), batched_reference[:, :m])
            for m in range(rows, PROBE_ROWS)
        ):
            return rows
    return PROBE_ROWS
