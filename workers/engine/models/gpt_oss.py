"""gpt-oss (GptOssForCausalLM), as transformers defines it: layers alternating between a sliding
window and full attention (layer_types), q/k/v and output biases, a learned sink per query head
(a logit in each row's softmax with no value, kernels.attention.sinks), YaRN rope, and routed
experts on every layer: a router with a bias that weights the softmax of its top-k logits, and
experts with biases whose SwiGLU is clamped (MoeConfig.swiglu_limit), stored fused as HF stores
them (gate_up_proj [E, hidden, 2 * inter], gate and up interleaved in its last dim).

The experts run as torch ops on every device (kernels.moe has no biases nor clamped SwiGLU). Only
unquantized checkpoints are served: the released MXFP4 ones are refused."""

import math
from typing import Any

import torch
from torch import nn

from workers.engine.config import ModelConfig, MoeConfig
from workers.engine.layers.moe import SparseMoeBlock, build_router
from workers.engine.models.decoder import Attention, DecoderForCausalLM, DecoderLayer
from workers.engine.models.family import FULL_ATTENTION, SLIDING_ATTENTION, DecoderFamily
from workers.protocol.errors import ModelLoadError

# transformers' GptOssConfig defaults for the keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
# Its rope when a config names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class SinkAttention(Attention):
    """Attention with an output bias where the config has attention biases, and a sink per query head."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__(config, window)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))


class ClampedSwigluExperts(nn.Module):
    """All E experts of a layer in HF's layout: gate_up_proj [E, H, 2I] (gate and up interleaved),
    down_proj [E, I, H], each with a bias. Called as RoutedExperts is: (hidden [T, H], topk_ids
    [T, k], topk_weights [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, limit: float, alpha: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.limit = limit
        self.alpha = alpha

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_every_expert(hidden, topk_ids, topk_weights)
        out = torch.zeros_like(hidden)
        # The experts some token chose, in order; reading them syncs with the host.
        for expert in torch.unique(topk_ids).tolist():
            tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
            weighted = self.expert(expert, hidden[tokens]) * topk_weights[tokens, slots, None]
            out.index_add_(0, tokens, weighted.to(out.dtype))
        return out

    def forward_every_expert(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert over every token, weighted 0 where a token did not choose it: nothing is read
        on the host, so a CUDA graph can capture it (decode steps, whose few tokens reach most
        experts anyway)."""
        out = torch.zeros_like(hidden)
        for expert in range(self.gate_up_proj.shape[0]):
            weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)
            out += (self.expert(expert, hidden) * weight).to(out.dtype)
        return out

    def expert(self, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = hidden @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return gated @ self.down_proj[expert] + self.down_proj_bias[expert]


class GptOssDecoderLayer(DecoderLayer):
    def build_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        return SinkAttention(config, config.layer_windows[layer])

    def build_feed_forward(self, config: ModelConfig, layer: int) -> nn.Module:
        moe = config.moe
        experts = ClampedSwigluExperts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, limit=moe.swiglu_limit, alpha=moe.swiglu_alpha
        )
        return SparseMoeBlock(build_router(moe, config.hidden_size), experts)


class GptOssForCausalLM(DecoderForCausalLM):
    layer_class = GptOssDecoderLayer

    def expected_hf_names(self) -> set[str]:
        config = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not config.tie_word_embeddings:
            names.add("lm_head.weight")
        projections = [f"self_attn.{p}_proj" for p in ("q", "k", "v", "o")]
        per_layer = [f"{p}.weight" for p in projections] + ["self_attn.sinks"]
        if config.attention_bias:
            per_layer += [f"{p}.bias" for p in projections]
        per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
        per_layer += ["mlp.router.weight", "mlp.router.bias"]
        per_layer += [f"mlp.experts.{p}" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
        return {f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in per_layer} | names


class GptOss(DecoderFamily):
    name = "gpt_oss"
    model_class = GptOssForCausalLM

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        quantization = hf.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ModelLoadError(
                f"quantized gpt-oss checkpoints (quantization_config: {method}) are not served; "
                "use a dequantized (bf16) one"
            )
        hf = {**HF_DEFAULTS, **hf}
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            hf["rope_parameters"] = DEFAULT_ROPE
        return super().model_config(hf)

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf["attention_bias"])

    def layer_windows(self, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        if hf.get("layer_types") is None:
            # HF's default: windowed and full layers alternate, the first windowed.
            hf = {**hf, "layer_types": [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]}
        return super().layer_windows(hf, num_layers)

    def moe_config(self, hf: dict[str, Any], num_layers: int) -> MoeConfig:
        num_experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        return MoeConfig(
            num_experts=int(num_experts),
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["intermediate_size"]),
            routing="topk_softmax",
            norm_topk_prob=False,
            sparse_layers=(True,) * num_layers,
            swiglu_limit=_number(hf, "swiglu_limit"),
            swiglu_alpha=_number(hf, "swiglu_alpha"),
        )


def _number(hf: dict[str, Any], name: str) -> float:
    value = hf[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{name} must be a finite number, got {value!r}")
    return float(value)
