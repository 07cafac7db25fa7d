"""A sparse mixture-of-experts feed-forward block: a router picks k experts per token, the routed
experts run them, and optional shared experts see every token.

The three parts are separate modules so each can be replaced without touching the model code:
- a router: `forward(hidden [T, H]) -> (topk_ids int64 [T, k] logical expert ids, topk_weights
  float32 [T, k])`; `SoftmaxTopKRouter` (Qwen2-MoE, Qwen3-MoE), `GroupedSigmoidRouter`
  (DeepSeek-V3 routing), `GroupedSoftmaxRouter` (DeepSeek-V2 routing) and `TopKSoftmaxRouter`
  (gpt-oss);
- the experts: `forward(hidden, topk_ids, topk_weights) -> [T, H]`; `RoutedExperts` holds all E
  experts of a layer in one process (slot = expert id), an expert-parallel module holds some of them;
  either loads a checkpoint's per-expert tensors through `load_expert_weight`;
- the shared expert: a dense MLP called as `(hidden, fused=)`, optionally scaled per token by
  sigmoid(shared_expert_gate(hidden)) (Qwen2-MoE).
No part reads a device value on the host, so the block runs inside a captured CUDA graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import experts as run_experts
from kernels.quant.fp8_blocks import FP8, block_grid, dequantize_weight_blocks
from workers.engine.config import ROUTINGS, MoeConfig
from workers.engine.layers.fp8_linear import QuantizedRows
from workers.engine.weights.quantization import BlockQuantized
from workers.protocol.errors import ModelLoadError

EXPERT_PROJECTIONS = ("gate", "up", "down")


class SoftmaxTopKRouter(nn.Module):
    """The k most probable experts under softmax(logits), optionally renormalised to sum to 1."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logits in the hidden dtype and the softmax in float32, as HF computes them.
        probs = F.linear(hidden, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-V3 routing: sigmoid scores; the experts are split into num_groups groups, each
    scored by the sum of its best two experts, and a token picks its top k among the experts of its
    best topk_groups groups. e_score_correction_bias (a load-balancing term learnt in training)
    shifts the scores for these choices only: the weights are the chosen experts' own scores,
    optionally normalised, times routed_scaling_factor. All in float32."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.num_experts = num_experts
        self.init_buffers()
        self.top_k = top_k
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def init_buffers(self) -> None:
        """A zero correction bias (a checkpoint's overwrites it) on the default device, at construction and
        once a model built on meta has storage (workers.engine.materialize). A buffer so that it stays
        float32 when the parameters move to a low-precision dtype."""
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        tokens, num_experts = choice.shape
        group_scores = choice.view(tokens, self.num_groups, num_experts // self.num_groups).topk(2, dim=-1).values
        choice = within_best_groups(choice, group_scores.sum(dim=-1), self.topk_groups)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class GroupedSoftmaxRouter(nn.Module):
    """DeepSeek-V2 routing: softmax scores over all experts; the experts are split into num_groups
    groups, each scored by its best expert, and a token picks its top k among the experts of its best
    topk_groups groups (one group: plain top-k, DeepSeek's "greedy"). The weights are the chosen
    experts' probabilities times routed_scaling_factor, not renormalised. All in float32."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int,
        topk_groups: int,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden.float(), self.weight.float()).softmax(dim=-1)
        choice = scores
        if self.topk_groups < self.num_groups:
            tokens, num_experts = scores.shape
            group_scores = scores.view(tokens, self.num_groups, num_experts // self.num_groups).amax(dim=-1)
            choice = within_best_groups(scores, group_scores, self.topk_groups)
        ids = choice.topk(self.top_k, dim=-1).indices
        return ids, scores.gather(1, ids) * self.routed_scaling_factor


class TopKSoftmaxRouter(nn.Module):
    """The k largest logits of a linear router with a bias, weighted by their softmax (gpt-oss): the
    same experts and weights as a renormalised top-k of softmax over all of them, in HF's op order."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = F.linear(hidden, self.weight, self.bias).topk(self.top_k, dim=-1)
        return ids, values.softmax(dim=-1, dtype=torch.float32)


def within_best_groups(choice: torch.Tensor, group_scores: torch.Tensor, topk_groups: int) -> torch.Tensor:
    """`choice` [T, E] with every expert outside a token's topk_groups best groups (by `group_scores`
    [T, G], the experts split into G equal groups in order) at -inf."""
    tokens, num_groups = group_scores.shape
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    by_group = choice.view(tokens, num_groups, -1)
    return by_group.masked_fill(~allowed[:, :, None], float("-inf")).view(tokens, -1)


def build_router(moe: MoeConfig, hidden_size: int) -> nn.Module:
    if moe.routing == "softmax":
        return SoftmaxTopKRouter(hidden_size, moe.num_experts, moe.top_k, norm_topk_prob=moe.norm_topk_prob)
    if moe.routing == "grouped_sigmoid":
        return GroupedSigmoidRouter(
            hidden_size,
            moe.num_experts,
            moe.top_k,
            num_groups=moe.num_groups,
            topk_groups=moe.topk_groups,
            norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
    if moe.routing == "grouped_softmax":
        return GroupedSoftmaxRouter(
            hidden_size,
            moe.num_experts,
            moe.top_k,
            num_groups=moe.num_groups,
            topk_groups=moe.topk_groups,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
    if moe.routing == "topk_softmax":
        return TopKSoftmaxRouter(hidden_size, moe.num_experts, moe.top_k)
    raise ModelLoadError(f"unknown MoE routing {moe.routing!r}; known: {', '.join(ROUTINGS)}")


class RoutedExperts(nn.Module):
    """All E experts of one layer, stacked: w13 [E, 2 * I, H] (gate rows, then up rows), w2 [E, H, I].

    After `use_fp8(block)` they load as block-scaled e4m3 (layers.fp8_linear): on CUDA they stay
    e4m3 with w13_scale_inv [E, ceil(2I / bn), ceil(H / bk)] and w2_scale_inv [E, ceil(H / bn),
    ceil(I / bk)], which the experts kernel reads; elsewhere they are dequantized when loading
    finishes into the model's dtype, and the reference loop runs them with the activations quantized
    per token and group of block_k channels, as the kernel does."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_scale_inv: torch.Tensor | None
        self.w2_scale_inv: torch.Tensor | None
        self.register_buffer("w13_scale_inv", None)
        self.register_buffer("w2_scale_inv", None)
        self.block: tuple[int, int] | None = None
        # While loading fp8: each (expert, "w13" / "w2") matrix's row writer.
        self._rows: dict[tuple[int, str], QuantizedRows] = {}

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts as block-scaled e4m3 (on the device the float ones were: meta, as a model
        is built for an fp8 load), to be loaded by load_expert_weight or load_experts."""
        self.block = block
        for name in ("w13", "w2"):
            weight = getattr(self, name)
            grid = block_grid(tuple(weight.shape[1:]), block)
            setattr(self, name, nn.Parameter(torch.empty_like(weight, dtype=FP8), requires_grad=False))
            scale_inv = torch.empty(weight.shape[0], *grid, dtype=torch.float32, device=weight.device)
            self.register_buffer(f"{name}_scale_inv", scale_inv)

    @property
    def quantized(self) -> bool:
        """Whether the experts are held in e4m3 (CUDA), not dequantized (elsewhere)."""
        return self.w13.dtype == FP8

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return run_experts(
                hidden,
                self.w13,
                self.w2,
                topk_ids,
                topk_weights,
                w13_scale_inv=self.w13_scale_inv,
                w2_scale_inv=self.w2_scale_inv,
                block=self.block,
            )
        # FP8 experts held dequantized (off CUDA) still quantize their activations, as on CUDA.
        group = self.block[1] if self.block is not None else None
        return run_experts(hidden, self.w13, self.w2, topk_ids, topk_weights, activation_group=group)

    def load_expert_weight(self, expert: int, projection: str, tensor: torch.Tensor | BlockQuantized) -> None:
        """Copy one expert's `gate`, `up` or `down` projection (HF's [out, in] layout) into place; a
        projection saved quantized is dequantized unless the experts are held in fp8."""
        if not 0 <= expert < self.w13.shape[0]:
            raise ModelLoadError(f"expert {expert} is out of range for a layer of {self.w13.shape[0]} experts")
        intermediate = self.intermediate_size
        if projection not in EXPERT_PROJECTIONS:
            raise ModelLoadError(f"unknown expert projection {projection!r}; known: {EXPERT_PROJECTIONS}")
        if self.block is not None:
            matrix, offset = ("w2", 0) if projection == "down" else ("w13", 0 if projection == "gate" else intermediate)
            self._writer(expert, matrix).write(offset, tensor, f"expert {expert}'s {projection} projection")
            return
        targets = {
            "gate": self.w13.data[expert, :intermediate],
            "up": self.w13.data[expert, intermediate:],
            "down": self.w2.data[expert],
        }
        target = targets[projection]
        if target.shape != tensor.shape:
            raise ModelLoadError(
                f"expert {expert}'s {projection} projection has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        if isinstance(tensor, BlockQuantized):
            tensor = tensor.dequantize(torch.float32)
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))

    def load_experts(self, matrix: str, first: int, weights: torch.Tensor) -> None:
        """Experts first.. of `matrix` ("w13" or "w2") from float `weights` [n, rows, cols], quantized
        (random weights, drawn a few experts at a time)."""
        for index, weight in enumerate(weights):
            expert = first + index
            self._writer(expert, matrix).write(0, weight, f"expert {expert}'s {matrix}")

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Quantize what was assembled in float32; off CUDA, dequantize into `dtype` for good."""
        if not self.quantized:
            return
        for rows in self._rows.values():
            rows.finish()
        self._rows = {}
        if self.w13.device.type == "cuda":
            return
        for name in ("w13", "w2"):
            values, scale_inv = getattr(self, name).data, getattr(self, f"{name}_scale_inv")
            # Expert by expert: dequantizing the stack at once would take several float32 copies of it.
            real = torch.empty(values.shape, dtype=dtype, device=values.device)
            for expert, (expert_values, expert_scale_inv) in enumerate(zip(values, scale_inv, strict=True)):
                real[expert] = dequantize_weight_blocks(expert_values, expert_scale_inv, self.block, dtype)
            setattr(self, name, nn.Parameter(real, requires_grad=False))
            setattr(self, f"{name}_scale_inv", None)

    def _writer(self, expert: int, matrix: str) -> QuantizedRows:
        key = (expert, matrix)
        if key not in self._rows:
            values, scale_inv = getattr(self, matrix).data[expert], getattr(self, f"{matrix}_scale_inv")[expert]
            self._rows[key] = QuantizedRows(values, scale_inv, self.block)
        return self._rows[key]


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        router: nn.Module,
        experts: nn.Module,
        *,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, hidden: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """`fused` selects the shared expert's fused SiLU·mul (CUDA), as for a dense MLP."""
        topk_ids, topk_weights = self.router(hidden)
        out = self.experts(hidden, topk_ids, topk_weights)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(hidden, fused=fused)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out + shared
