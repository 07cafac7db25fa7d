"""A linear layer whose weight is block-scaled e4m3 (DeepSeek-V3's FP8 format, weights.quantization).

On CUDA it keeps `weight` e4m3 [N, K] and `weight_scale_inv` float32 per (block_n, block_k) tile, and
runs the W8A8 block GEMM (kernels.quant.fp8_gemm), which quantizes the activation per token and
1 x block_k group itself. Elsewhere the weight is dequantized once, when loading finishes, into the
model's dtype, and the forward quantizes the activation exactly as that kernel does
(kernels.quant.fp8_blocks.w8a8_block_matmul_reference), so CPU numerics model the GPU's.

Loading writes row ranges: a fused projection (q/k/v, gate/up) is its checkpoint parts stacked along
N. Stacking quantized parts is exact when each part starts and ends on a block_n boundary (or at N),
since then every tile belongs to one part. Where one does not (a tiny model's k/v heads, an MoE's
odd intermediate size), its rows are assembled in float32 and their tile rows quantized when loading
finishes: tiles that straddle two parts share one scale, a second rounding for a saved part's values.
Tile rows that an aligned part filled keep the tiles it was quantized to.

Float weights are quantized with each tile's scale searched (SEARCHED_SCALE_FACTORS): of a few
scales around amax / 448, the one whose rounding has the least squared error.
"""

import torch
from torch import nn

from kernels.quant.fp8_blocks import (
    FP8,
    SEARCHED_SCALE_FACTORS,
    block_grid,
    dequantize_weight_blocks,
    dequantized_w8a8,
    quantize_weight_blocks,
)
from workers.engine.weights.quantization import BlockQuantized
from workers.protocol.errors import ModelLoadError

WeightPart = torch.Tensor | BlockQuantized


class QuantizedRows:
    """Writes row ranges of one block-quantized [N, K] matrix into its e4m3 `values` and float32
    `scale_inv` (views of a module's tensors), from float parts or parts saved quantized."""

    def __init__(self, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        self.values = values
        self.scale_inv = scale_inv
        self.block = block
        # float32 [N, K] once a part is not tile-aligned: its tile rows (`staged`, per tile row) are
        # quantized by finish().
        self.staging: torch.Tensor | None = None
        self.staged: torch.Tensor | None = None
        self.rows_written = 0

    def write(self, offset: int, part: WeightPart, name: str) -> None:
        rows, cols = self.values.shape
        n = part.shape[0]
        if part.shape[1:] != (cols,) or not 0 <= offset <= rows - n:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(part.shape)}, expected rows {offset}..{offset + n} "
                f"of a [{rows}, {cols}] weight"
            )
        block_n = self.block[0]
        self.rows_written += n
        if offset % block_n == 0 and (n % block_n == 0 or offset + n == rows):
            if isinstance(part, BlockQuantized):
                values, scale_inv = part.values, part.scale_inv
            else:
                part = part.to(self.values.device)
                values, scale_inv = quantize_weight_blocks(part, self.block, scale_factors=SEARCHED_SCALE_FACTORS)
            first = offset // block_n
            self.values[offset : offset + n].copy_(values)
            self.scale_inv[first : first + scale_inv.shape[0]].copy_(scale_inv)
        else:
            self._stage(offset, part)
        if self.rows_written == rows:
            # Every part is in: the staged tile rows are quantized now, not held in float32 (every
            # expert's) until loading ends.
            self.finish()

    def _stage(self, offset: int, part: WeightPart) -> None:
        """Keep an unaligned part in float32 until the parts sharing its tile rows are in."""
        rows, cols = self.values.shape
        n, block_n = part.shape[0], self.block[0]
        if self.staging is None:
            self.staging = torch.zeros(rows, cols, dtype=torch.float32, device=self.values.device)
            self.staged = torch.zeros(self.scale_inv.shape[0], dtype=torch.bool, device=self.values.device)
        real = part.dequantize(torch.float32) if isinstance(part, BlockQuantized) else part.float()
        self.staging[offset : offset + n].copy_(real)
        self.staged[offset // block_n : (offset + n - 1) // block_n + 1] = True

    def finish(self) -> None:
        if self.staging is None:
            return
        values, scale_inv = quantize_weight_blocks(self.staging, self.block, scale_factors=SEARCHED_SCALE_FACTORS)
        staged_rows = self.staged.repeat_interleave(self.block[0])[: self.values.shape[0]]
        self.values.view(torch.uint8)[staged_rows] = values.view(torch.uint8)[staged_rows]
        self.scale_inv[self.staged] = scale_inv[self.staged]
        self.staging = self.staged = None


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, block: tuple[int, int]) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv: torch.Tensor | None
        scale_inv = torch.empty(block_grid((out_features, in_features), block), dtype=torch.float32)
        self.register_buffer("weight_scale_inv", scale_inv)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._rows: QuantizedRows | None = None

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int]) -> "Fp8Linear":
        """An Fp8Linear of `linear`'s shape on its device, its weights still to load."""
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features, bias=linear.bias is not None, block=block)

    @property
    def quantized(self) -> bool:
        """Whether the weight is held in e4m3 (CUDA), not dequantized (elsewhere)."""
        return self.weight.dtype == FP8

    def load_rows(self, offset: int, part: WeightPart, name: str) -> None:
        """Rows offset.. of the weight from checkpoint tensor `name` (a fused projection's part)."""
        if self._rows is None:
            self._rows = QuantizedRows(self.weight.data, self.weight_scale_inv, self.block)
        self._rows.write(offset, part, name)

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Quantize what was assembled in float32; off CUDA, dequantize into `dtype` for good."""
        if self._rows is not None:
            self._rows.finish()
            self._rows = None
        if self.weight.device.type == "cuda":
            return
        real = dequantize_weight_blocks(self.weight.data, self.weight_scale_inv, self.block, dtype)
        self.weight = nn.Parameter(real, requires_grad=False)
        self.weight_scale_inv = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            from kernels.quant.fp8_gemm import w8a8_block_fp8_matmul  # CUDA only

            return w8a8_block_fp8_matmul(x, self.weight, self.weight_scale_inv, block=self.block, bias=self.bias)
        return dequantized_w8a8(x, self.weight, self.block[1], self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"
