"""The shape of a model (workers.engine.models.registry reads it from a Hugging Face config) and how the
engine serves it."""

import math
from dataclasses import dataclass

import torch

from workers.args import EngineArgs
from workers.cost_model import PrefillCostModel
from workers.engine.dtypes import torch_dtype
from workers.protocol.errors import ModelLoadError

ROUTINGS = ("softmax", "grouped_sigmoid", "grouped_softmax", "topk_softmax")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    # "default", "linear", "llama3" or "yarn"; the remaining fields are read only by the scaled kinds.
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # YaRN: the rotations per original context below which a pair is interpolated (beta_slow) and
    # above which it keeps its frequency (beta_fast), the ramp's ends rounded outwards with truncate.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # cos and sin are scaled by it (YaRN's attention temperature; HF's attention_scaling).
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The mixture-of-experts part of a decoder: which layers route, and how."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    # "softmax": top-k of softmax(logits) (Qwen). "grouped_sigmoid": DeepSeek-V3's sigmoid scores,
    # top-k within the best topk_groups of num_groups groups, chosen with e_score_correction_bias.
    # "grouped_softmax": DeepSeek-V2's softmax scores, top-k within the best topk_groups of num_groups
    # groups, each scored by its best expert (one group: plain top-k), times routed_scaling_factor.
    # "topk_softmax": gpt-oss's softmax over the top-k logits of a router with a bias.
    routing: str
    norm_topk_prob: bool
    # Per layer: whether its feed-forward is the routed experts (else the dense MLP).
    sparse_layers: tuple[bool, ...]
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # of the shared expert(s), 0 for none
    shared_expert_gate: bool = False  # Qwen2-MoE scales the shared expert by sigmoid(gate(x))
    # gpt-oss's experts (with biases): the gate clamped above and the up projection to ±swiglu_limit,
    # then gate * sigmoid(swiglu_alpha * gate) * (up + 1). None: SiLU(gate) * up, no biases.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Per multi-token-prediction layer (ModelConfig.mtp_layers): whether it routes, as sparse_layers.
    mtp_sparse_layers: tuple[bool, ...] = ()

    def routes(self, layer: int) -> bool:
        """Whether the checkpoint's layer `layer` routes: a served layer, or past them an MTP layer."""
        served = len(self.sparse_layers)
        return self.sparse_layers[layer] if layer < served else self.mtp_sparse_layers[layer - served]

    def validate(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ModelLoadError(
                f"a MoE model needs at least one expert of positive size, got {self.num_experts} experts "
                f"of moe_intermediate_size {self.intermediate_size}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok must be in [1, {self.num_experts}] (the experts), got {self.top_k}"
            )
        if self.routing not in ROUTINGS:
            raise ModelLoadError(f"unknown MoE routing {self.routing!r}; known: {', '.join(ROUTINGS)}")
        if self.routing in ("grouped_sigmoid", "grouped_softmax"):
            self._validate_groups()
        if self.routing == "grouped_softmax" and self.norm_topk_prob:
            # DeepSeek-V2's gate in HF never renormalises (DeepSeek's own code would, and drop the
            # scaling factor): the two disagree, so neither is guessed.
            raise ModelLoadError("norm_topk_prob is not supported with DeepSeek-V2 routing")
        if self.shared_intermediate_size < 0:
            raise ModelLoadError(f"the shared expert's size must not be negative, got {self.shared_intermediate_size}")
        if self.swiglu_limit is not None and not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            raise ModelLoadError(f"swiglu_limit must be a positive number, got {self.swiglu_limit}")
        if not math.isfinite(self.swiglu_alpha):
            raise ModelLoadError(f"swiglu_alpha must be a finite number, got {self.swiglu_alpha}")

    def _validate_groups(self) -> None:
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ModelLoadError(f"n_group ({self.num_groups}) must divide the {self.num_experts} experts")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ModelLoadError(f"topk_group must be in [1, n_group={self.num_groups}], got {self.topk_groups}")
        per_group = self.num_experts // self.num_groups
        # grouped_sigmoid scores a group by the sum of its best two experts' scores.
        if self.routing == "grouped_sigmoid" and per_group < 2:
            raise ModelLoadError(f"each of the n_group={self.num_groups} groups needs two experts or more")
        if self.top_k > self.topk_groups * per_group:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) exceeds the {self.topk_groups * per_group} experts "
                f"of the topk_group={self.topk_groups} groups a token may use"
            )
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ModelLoadError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}")


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): per token and layer the cache keeps one latent,
    the kv_lora_rank-wide compressed KV followed by a qk_rope_head_dim-wide rotary key shared by
    every head; each head's query and key are qk_nope_head_dim + qk_rope_head_dim wide, its value
    v_head_dim."""

    q_lora_rank: int | None  # None: queries are projected straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The softmax scale: qk_head_dim ** -0.5, times YaRN's mscale squared where the rope scaling
    # asks for it (mscale_all_dim), as DeepSeek's attention does.
    softmax_scale: float
    # Rotary pairs of adjacent dims (DeepSeek's layout) rather than the two halves of the rope part.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values one token keeps per layer: the compressed KV and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ModelLoadError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ModelLoadError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
            raise ModelLoadError(f"the softmax scale must be positive, got {self.softmax_scale}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder shape, read once from an HF config dict and checked for consistency."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # Per layer: None for full attention, else the number of most recent tokens a query sees
    # (itself included), as HF's sliding-window mask defines it.
    layer_windows: tuple[int | None, ...]
    dtype: torch.dtype
    initializer_range: float = 0.02
    moe: MoeConfig | None = None  # None for dense models
    # Multi-head latent attention (None: every head's keys and values are cached). With it, head_dim
    # is a query's and key's width (qk_nope_head_dim + qk_rope_head_dim) and num_kv_heads num_heads.
    mla: MlaConfig | None = None
    # DeepSeek-V3's multi-token-prediction layers, which a checkpoint holds past num_layers
    # (num_nextn_predict_layers): loaded into models.mtp's predictor where the loader is asked for
    # it, else their tensors are skipped.
    mtp_layers: int = 0

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} must be positive, got {getattr(self, name)}")
        if self.moe is not None:
            self.moe.validate()
        if self.mla is not None:
            self.mla.validate()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model: its settings (EngineArgs, which define, default and check each one)
    and what workers.engine.builder resolves from them before the model loads."""

    args: EngineArgs
    # The fitted step-time model (bench.fit_cost_model) args.cost_model names: with it the engine tracks
    # how far its predictions are off; with step_budget_s too, each step is also capped to that predicted time.
    cost_model: PrefillCostModel | None

    @property
    def dtype(self) -> torch.dtype | None:
        """None: float32 on the CPU, bfloat16 on CUDA."""
        return torch_dtype(self.args.dtype) if self.args.dtype else None

    @property
    def step_budget_s(self) -> float | None:
        return self.args.step_budget_ms / 1000 if self.args.step_budget_ms is not None else None
