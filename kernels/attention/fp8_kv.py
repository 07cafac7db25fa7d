"""The FP8 KV cache's row format: how one token's plane of one head (a key, a value, or an MLA latent)
is kept in `--kv-cache-dtype fp8`, shared by the cache, every attention backend, the store's block files
and the handoff.

A row of `width` values is `width` e4m3 bytes followed by one float32 scale per group of
`scale_group(width)` consecutive values (value = e4m3 * scale), then zeros up to a multiple of
ROW_ALIGN bytes, in one uint8 row of `row_bytes(width)`: a head of 128 takes 144 bytes instead of
bf16's 256. The padding is what lets the attention kernels read a row's e4m3 bytes in 16-byte
vectors: Triton vectorizes a gather only as far as it can prove the rows' alignment, and 132-byte
rows compiled (sm_90) to 4-byte async copies, four times the load instructions of a bf16 row.
Pages start zeroed and no kernel writes the padding, so it stays zero in pages, runs and store files.

The scales sit beside their values, per token, because a page fills token by token: a scale per page
would have to be fixed before the page's later tokens are seen (clipping them) or rewritten with the
page. DeepSeek's persisted KV keeps its scales inline the same way (512 latent values and 4 float32
scales: 528 bytes, already a multiple of 16).

Groups are at most 128 values (the gcd of the width and 128), so the scale offset (`width`) is 4-byte
aligned for every width a model uses (a multiple of 4) and a Triton kernel can load scales as float32.
"""

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MAX_SCALE_GROUP = 128
SCALE_BYTES = 4  # float32
ROW_ALIGN = 16  # bytes: one vector load
MIN_AMAX = 1e-12  # a zero group still gets a usable scale


def scale_group(width: int) -> int:
    """Values sharing one scale in a row of `width`."""
    return math.gcd(width, MAX_SCALE_GROUP)


def scales_end(width: int) -> int:
    """Byte offset where a row's scales end (and its padding starts)."""
    if width < 1 or width % SCALE_BYTES:
        raise ValueError(f"an FP8 KV row needs a positive width that is a multiple of {SCALE_BYTES}, got {width}")
    return width + SCALE_BYTES * (width // scale_group(width))


def row_bytes(width: int) -> int:
    """Bytes of one stored row of `width` values: the e4m3 values, the float32 scales, the padding."""
    return -(-scales_end(width) // ROW_ALIGN) * ROW_ALIGN


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """uint8 rows [..., row_bytes(width)] of `x` [..., width]: each group scaled so its largest
    magnitude maps to e4m3's largest."""
    width = x.shape[-1]
    group = scale_group(width)
    grouped = x.float().unflatten(-1, (width // group, group))
    scales = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    values = (grouped / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
    padding = values.new_zeros((*values.shape[:-1], row_bytes(width) - scales_end(width)), dtype=torch.uint8)
    return torch.cat([values.view(torch.uint8), scales.squeeze(-1).contiguous().view(torch.uint8), padding], dim=-1)


def dequantize_rows(rows: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The values [..., width] of uint8 rows [..., row_bytes(width)] in `dtype`."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != row_bytes(width):
        raise ValueError(
            f"FP8 KV rows of width {width} are uint8 of {row_bytes(width)} bytes, got {rows.dtype} {tuple(rows.shape)}"
        )
    group = scale_group(width)
    values = rows[..., :width].contiguous().view(FP8).float().unflatten(-1, (width // group, group))
    scales = rows[..., width : scales_end(width)].contiguous().view(torch.float32).unsqueeze(-1)
    return (values * scales).flatten(-2).to(dtype)
