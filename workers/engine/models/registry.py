"""Hugging Face model configs read into the engine's ModelConfig, by architecture."""

from typing import Any

import torch

from workers.args import DTYPES, torch_dtype
from workers.engine.config import ModelConfig, MoeConfig, RopeConfig
from workers.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    # dots.llm1: Qwen3-style attention with DeepSeek-V3's MoE, our model for DeepSeek-V3 routing
    # until MLA attention is served.
    "Dots1ForCausalLM": "dots1",
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "dots1")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def model_config(hf: dict[str, Any]) -> ModelConfig:
    """The decoder shape of a Hugging Face config dict, checked for consistency."""
    architectures = hf.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or hf.get('model_type')!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        config = ModelConfig(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its HF config does not say so.
            attention_bias=_attention_bias(hf, family),
            qk_norm=family in ("qwen3", "qwen3_moe", "dots1"),
            layer_windows=_layer_windows(hf, num_layers, family),
            dtype=_dtype(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            moe=_moe_config(hf, family, num_layers),
        )
    except KeyError as missing:
        raise ModelLoadError(f"model config lacks required field {missing}") from None
    except (TypeError, ValueError) as malformed:
        raise ModelLoadError(f"model config has a malformed field: {malformed}") from None
    config.validate()
    return config


def _attention_bias(hf: dict[str, Any], family: str) -> bool:
    if family == "qwen2":
        return bool(hf.get("attention_bias", True))  # Qwen2 always has q/k/v biases; its config does not say so
    if family == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    bias = bool(hf.get("attention_bias", False))
    if bias and family == "dots1":
        raise ModelLoadError("dots1 with attention_bias (which also biases o_proj) is not supported")
    return bias


def _moe_config(hf: dict[str, Any], family: str, num_layers: int) -> MoeConfig | None:
    """The routed-experts settings of a MoE family, None for a dense one; which layers are sparse
    follows each family's HF definition."""
    if family not in MOE_FAMILIES:
        return None
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} for experts; supported: silu")
    top_k = int(hf["num_experts_per_tok"])
    intermediate = int(hf["moe_intermediate_size"])
    norm_topk_prob = bool(hf.get("norm_topk_prob", False))
    if family == "dots1":
        first_sparse = int(hf.get("first_k_dense_replace") or 0)
        if not 0 <= first_sparse <= num_layers:
            raise ModelLoadError(f"first_k_dense_replace must be in [0, {num_layers}], got {first_sparse}")
        return MoeConfig(
            num_experts=int(hf.get("n_routed_experts") or 0),
            top_k=top_k,
            intermediate_size=intermediate,
            routing="grouped_sigmoid",
            norm_topk_prob=norm_topk_prob,
            sparse_layers=tuple(i >= first_sparse for i in range(num_layers)),
            num_groups=int(hf.get("n_group") or 1),
            topk_groups=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_intermediate_size=intermediate * int(hf.get("n_shared_experts") or 0),
        )
    # Qwen2-MoE's shared expert is always scaled by its sigmoid gate; Qwen3-MoE has none.
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    dense_layers = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step must be at least 1, got {step}")
    if not dense_layers <= set(range(num_layers)):
        raise ModelLoadError(f"mlp_only_layers {sorted(dense_layers)} name layers outside 0..{num_layers - 1}")
    return MoeConfig(
        num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        top_k=top_k,
        intermediate_size=intermediate,
        routing="softmax",
        norm_topk_prob=norm_topk_prob,
        sparse_layers=tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings are not supported (partial_rotary_factor={partial})")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)
        ),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    )


def _layer_windows(hf: dict[str, Any], num_layers: int, family: str) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None and family == "dots1" and window is not None:
        # dots.llm1 windows the layers from max_window_layers on (HF's default is 62).
        first_sliding = int(hf.get("max_window_layers", 62))
        layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    if layer_types is None:
        if window is None or hf.get("use_sliding_window") is False:
            return (None,) * num_layers
        # Qwen-style configs window the layers from max_window_layers on (HF's default is 28);
        # Qwen3-MoE's windows every layer.
        windows_from = int(hf.get("max_window_layers", 28)) if family != "qwen3_moe" else 0
        first_sliding = windows_from if "use_sliding_window" in hf else 0
        layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise ModelLoadError(f"unsupported layer types {sorted(unknown)}")
    if SLIDING_ATTENTION in layer_types and not window:
        raise ModelLoadError("layer_types asks for sliding attention but sliding_window is not set")
    return tuple(int(window) if t == SLIDING_ATTENTION else None for t in layer_types)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return torch_dtype(name)
