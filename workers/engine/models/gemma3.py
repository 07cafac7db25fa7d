"""Gemma 3, text only (Gemma3ForCausalLM, model_type gemma3_text): the decoder with Gemma's offset
RMSNorm (scaled by 1 + weight) everywhere, embeddings scaled by sqrt(hidden_size), per-head norms of
queries and keys, four "sandwich" norms per layer (before and after attention and the MLP), a gated
GELU MLP, attention scaled by query_pre_attn_scalar ** -0.5 and tied embeddings. Its layers interleave
sliding-window (local) and full (global) attention, each kind with its own rope: local layers turn at
rope_local_base_freq, global ones at rope_theta with the config's rope scaling. Final-logit
softcapping is applied as HF does; attention-logit softcapping, which HF's Gemma 3 never applies, is
refused.

Gemma 3 has no fused-ops path: on CUDA it runs the torch reference ops (use_fused_ops says so).
"""

import logging
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBackend
from workers.engine.config import ModelConfig, RopeConfig
from workers.engine.layers.norm import OffsetRMSNorm
from workers.engine.layers.rotary import RotaryEmbedding
from workers.engine.models.decoder import MLP, Attention, DecoderForCausalLM, KVCache, RotaryAngles
from workers.engine.models.family import FULL_ATTENTION, SLIDING_ATTENTION, DecoderFamily
from workers.protocol.errors import ModelLoadError

log = logging.getLogger(__name__)

# HF's Gemma3TextConfig defaults where they differ from what DecoderFamily assumes of a missing field.
GEMMA3_DEFAULTS = {
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# Without layer_types, every sliding_window_pattern-th layer is global (HF's default pattern: 6).
DEFAULT_SLIDING_WINDOW_PATTERN = 6
# HF's activation names → torch's GELU approximation.
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class Gemma3Config(ModelConfig):
    """The decoder shape with what only Gemma 3 has; `rope` is the global layers' rope."""

    sliding_rope: RopeConfig = field(kw_only=True)
    attention_scale: float = field(kw_only=True)  # query_pre_attn_scalar ** -0.5
    gelu_approximation: str = field(kw_only=True)  # torch's name: "tanh" or "none"
    final_logit_softcapping: float | None = field(kw_only=True)


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(embedding_dim), the factor rounded to the weights' dtype as HF's Gemma does.
    Tied logits read the unscaled weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.init_buffers()

    def init_buffers(self) -> None:
        """The factor, in the default dtype (the model's) on the default device: at construction, and again
        once a model built on meta has storage (workers.engine.materialize)."""
        self.register_buffer("scale", torch.tensor(self.embedding_dim**0.5), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale.to(self.weight.dtype)


class LayerTypeAngles(NamedTuple):
    full: RotaryAngles
    sliding: RotaryAngles


class LayerTypeRotary(nn.Module):
    """A rotary table per layer type; `angles` looks both up once per step for every layer."""

    def __init__(self, full: RopeConfig, sliding: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.full = RotaryEmbedding(full, head_dim, max_positions)
        self.sliding = RotaryEmbedding(sliding, head_dim, max_positions)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> LayerTypeAngles:
        return LayerTypeAngles(self.full.angles(positions, dtype), self.sliding.angles(positions, dtype))


class Gemma3Attention(Attention):
    def __init__(self, config: Gemma3Config, window: int | None) -> None:
        super().__init__(config, window)
        self.scale = config.attention_scale
        self.q_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)


class GeluMLP(MLP):
    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int) -> None:
        super().__init__()
        window = config.layer_windows[layer]
        self.sliding = window is not None
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, window)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps)
        self.mlp = GeluMLP(size, config.intermediate_size, config.gelu_approximation)
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        angles: LayerTypeAngles,
        kv_cache: KVCache,
        metadata: Any,
        backend: AttentionBackend,
        rotary: LayerTypeRotary,
    ) -> torch.Tensor:
        own_angles, own_rotary = (angles.sliding, rotary.sliding) if self.sliding else (angles.full, rotary.full)
        attended = self.self_attn(
            self.input_layernorm(hidden), positions, own_angles, kv_cache, metadata, backend, own_rotary
        )
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3ForCausalLM(DecoderForCausalLM):
    embedding_class = ScaledEmbedding
    layer_class = Gemma3DecoderLayer
    norm_class = OffsetRMSNorm
    config: Gemma3Config

    def __init__(self, config: Gemma3Config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.rotary = LayerTypeRotary(config.rope, config.sliding_rope, config.head_dim, max_positions)

    def use_fused_ops(self, enabled: bool) -> None:
        if enabled:
            log.warning("Gemma 3 has no fused-ops path: it runs the torch reference ops")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def init_random_weights(self, seed: int) -> None:
        super().init_random_weights(seed)
        # An offset norm's identity is a zero weight, which is how HF initializes Gemma's.
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, OffsetRMSNorm):
                    module.weight.zero_()

    def expected_hf_names(self) -> set[str]:
        """The decoder's tensors and Gemma's sandwich norms."""
        layers = range(self.config.num_layers)
        sandwich = {f"model.layers.{layer}.{norm}.weight" for layer in layers for norm in SANDWICH_NORMS}
        return super().expected_hf_names() | sandwich


class Gemma3(DecoderFamily):
    name = "gemma3"
    qk_norm = True
    model_class = Gemma3ForCausalLM

    def model_config(self, hf: dict[str, Any]) -> Gemma3Config:
        hf = {**GEMMA3_DEFAULTS, **hf}
        _refuse_unapplied_settings(hf)
        full_rope, sliding_rope = _rope_by_layer_type(hf)
        # DecoderFamily reads the global layers' rope, alone, from rope_parameters.
        base = super().model_config({**hf, "rope_scaling": None, "rope_parameters": full_rope})
        return Gemma3Config(
            **{shared.name: getattr(base, shared.name) for shared in fields(ModelConfig)},
            sliding_rope=sliding_rope,
            attention_scale=_positive(hf, "query_pre_attn_scalar") ** -0.5,
            gelu_approximation=GELU_APPROXIMATIONS[hf["hidden_activation"]],
            final_logit_softcapping=(
                None if hf.get("final_logit_softcapping") is None else _positive(hf, "final_logit_softcapping")
            ),
        )

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        if hf.get("attention_bias"):
            # HF's Gemma 3 then biases o_proj too, which our attention has no place for.
            raise ModelLoadError("Gemma 3 with attention_bias is not supported")
        return False

    def layer_windows(self, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        if hf.get("layer_types") is None:
            pattern = int(hf.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN)
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
            hf = {**hf, "layer_types": layer_types}
        return super().layer_windows(hf, num_layers)


def _refuse_unapplied_settings(hf: dict[str, Any]) -> None:
    if hf.get("attn_logit_softcapping") is not None:
        # HF's Gemma 3 attention never passes the cap on, so serving it would diverge from HF.
        raise ModelLoadError(
            f"attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not supported for Gemma 3 "
            "(transformers ignores it; set it to null)"
        )
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported: the engine serves causal attention only")
    if hf["hidden_activation"] not in GELU_APPROXIMATIONS:
        raise ModelLoadError(
            f"unsupported hidden_activation {hf['hidden_activation']!r}; supported: {', '.join(GELU_APPROXIMATIONS)}"
        )


def _rope_by_layer_type(hf: dict[str, Any]) -> tuple[dict[str, Any], RopeConfig]:
    """The global layers' rope settings (for DecoderFamily to read) and the local layers' rope. HF 5
    writes rope_parameters per layer type; older configs rope_theta, rope_scaling (global layers
    only) and rope_local_base_freq."""
    by_type = hf.get("rope_parameters") or {}
    if not isinstance(by_type, dict) or set(by_type) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ModelLoadError(
            f"Gemma 3's rope_parameters must map {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r} to rope settings, "
            f"got {by_type!r}"
        )
    full = {**(by_type.get(FULL_ATTENTION) or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf["rope_theta"])
    sliding = dict(by_type.get(SLIDING_ATTENTION) or {})
    kind = sliding.get("rope_type") or sliding.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(
            f"rope_parameters.{SLIDING_ATTENTION} has rope type {kind!r}; sliding layers support only 'default'"
        )
    try:
        theta = float(sliding.get("rope_theta", hf["rope_local_base_freq"]))
    except (TypeError, ValueError):
        raise ModelLoadError(f"the sliding layers' rope theta is malformed: {sliding!r}") from None
    return full, RopeConfig(theta=theta)


def _positive(hf: dict[str, Any], name: str) -> float:
    try:
        value = float(hf[name])
    except (TypeError, ValueError):
        raise ModelLoadError(f"{name} must be a number, got {hf[name]!r}") from None
    if not value > 0:
        raise ModelLoadError(f"{name} must be positive, got {hf[name]!r}")
    return value
