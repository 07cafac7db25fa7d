"""A model family: how its Hugging Face config reads into the engine's ModelConfig, and the model class
that serves it. DecoderFamily reads what every family's config shares; a family overrides only what
its config says differently (attention biases, which layers slide, its experts)."""

from dataclasses import replace
from typing import Any, ClassVar

import torch

from workers.args import DTYPES
from workers.engine.config import MlaConfig, ModelConfig, MoeConfig, RopeConfig
from workers.engine.dtypes import torch_dtype
from workers.engine.layers.rotary import yarn_mscale
from workers.engine.models.decoder import DecoderForCausalLM
from workers.protocol.errors import ModelLoadError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


class DecoderFamily:
    name: ClassVar[str]
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm of queries and keys
    model_class: ClassVar[type[DecoderForCausalLM]] = DecoderForCausalLM

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        """The decoder shape of a Hugging Face config dict, checked for consistency."""
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            num_layers = int(hf["num_hidden_layers"])
            config = ModelConfig(
                family=self.name,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=self.num_kv_heads(hf, num_heads),
                head_dim=self.head_dim(hf, hidden_size, num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=_rope_config(hf),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=self.attention_bias(hf),
                qk_norm=self.qk_norm,
                layer_windows=self.layer_windows(hf, num_layers),
                dtype=_dtype(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                initializer_range=float(hf.get("initializer_range", 0.02)),
                moe=self.moe_config(hf, num_layers),
                mla=self.mla_config(hf),
                mtp_layers=self.mtp_layers(hf),
            )
        except KeyError as missing:
            raise ModelLoadError(f"model config lacks required field {missing}") from None
        except (TypeError, ValueError) as malformed:
            raise ModelLoadError(f"model config has a malformed field: {malformed}") from None
        config.validate()
        return config

    def num_kv_heads(self, hf: dict[str, Any], num_heads: int) -> int:
        return int(hf.get("num_key_value_heads") or num_heads)

    def mtp_layers(self, hf: dict[str, Any]) -> int:
        """The multi-token-prediction layers a checkpoint of this family holds past num_hidden_layers."""
        return 0

    def head_dim(self, hf: dict[str, Any], hidden_size: int, num_heads: int) -> int:
        """The width of a query and key head."""
        return int(hf.get("head_dim") or hidden_size // num_heads)

    def mla_config(self, hf: dict[str, Any]) -> MlaConfig | None:
        """The latent attention of an MLA family; None where every head's keys and values are cached."""
        return None

    def attention_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("attention_bias", False))

    def first_sliding_layer(self, hf: dict[str, Any]) -> int | None:
        """The first windowed layer of a config that sets sliding_window but not layer_types (None:
        no layer is). Qwen-style configs window the layers from max_window_layers on (HF's default
        is 28), all of them when use_sliding_window is not said."""
        if hf.get("use_sliding_window") is False:
            return None
        windows_from = int(hf.get("max_window_layers", 28))
        return windows_from if "use_sliding_window" in hf else 0

    def moe_config(self, hf: dict[str, Any], num_layers: int) -> MoeConfig | None:
        """The routed experts of a MoE family (which layers are sparse follows its HF definition);
        None for a dense one."""
        return None

    def layer_windows(self, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_sliding = None if window is None else self.first_sliding_layer(hf)
            if first_sliding is None:
                return (None,) * num_layers
            layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ModelLoadError(f"unsupported layer types {sorted(unknown)}")
        if SLIDING_ATTENTION in layer_types and not window:
            raise ModelLoadError("layer_types asks for sliding attention but sliding_window is not set")
        return tuple(int(window) if t == SLIDING_ATTENTION else None for t in layer_types)


def routed_expert_settings(hf: dict[str, Any]) -> tuple[int, int, bool]:
    """(num_experts_per_tok, moe_intermediate_size, norm_topk_prob), which every MoE family's config
    names alike; its experts must be SiLU's, the only ones served."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r} for experts; supported: silu")
    return int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The config's rope settings in one dict: transformers 5 writes `rope_parameters` (theta inside),
    older configs `rope_theta` and `rope_scaling`."""
    params = {**dict(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    params = rope_parameters(hf)
    kind = params["rope_type"]
    if kind not in ROPE_KINDS:
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_KINDS)}")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings are not supported (partial_rotary_factor={partial})")
    # As HF: a top-level original_max_position_embeddings (Phi-3 style) wins over the rope dict's.
    original_max = int(
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 8192)
    )
    rope = RopeConfig(
        theta=float(params["rope_theta"]),
        kind=kind,
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=original_max,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
    )
    return _yarn_config(rope, params, hf) if kind == "yarn" else rope


def _yarn_config(rope: RopeConfig, params: dict[str, Any], hf: dict[str, Any]) -> RopeConfig:
    """YaRN's settings, with HF's defaults and its attention factor."""
    # Without a factor, HF takes the ratio of the extended context to the original one.
    factor = float(
        params.get("factor") or int(hf.get("max_position_embeddings", 2048)) / rope.original_max_position_embeddings
    )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    return replace(
        rope,
        factor=factor,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return torch_dtype(name)
