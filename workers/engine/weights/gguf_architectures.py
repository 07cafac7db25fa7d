"""What llama.cpp's converter did to each architecture we read back from GGUF: the config its metadata
describes, the names it gave the tensors, and what it changed in their values.

llama: q/k rows permuted for llama.cpp's interleaved rope (undone by `unpermute_rotary_rows`).
gemma3: norms stored as 1 + weight (llama.cpp's norm multiplies by the weight, Gemma's by 1 + weight),
q/k left as they are (llama.cpp runs Gemma with the rotate-half "neox" rope, HF's layout); the
local layers' rope base and the 5:1 local/global pattern are not in the file, llama.cpp fixes them.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.protocol.errors import ModelLoadError

LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA3_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    # llama.cpp's ffn_norm is the norm before the MLP, which Gemma calls pre_feedforward_layernorm.
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 3 when the file does not say: every 6th layer global; the local layers' rope base
# is always 10000 (llama-model.cpp).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
# ... and 27B's 62 layers scale attention by hidden_size / heads instead of head_dim (its
# query_pre_attn_scalar), the one Gemma 3 whose two differ.
GEMMA3_27B_LAYERS = 62


class ArchitectureMetadata:
    """The GGUF metadata of one architecture: `read("block_count")` is `<arch>.block_count`."""

    def __init__(self, metadata: Mapping[str, object], architecture: str, source: Path) -> None:
        self.metadata, self.architecture, self.source = metadata, architecture, source

    def read(self, key: str, default: object = None) -> object:
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.source}: metadata '{self.architecture}.{key}' is missing")
        return value

    def optional(self, key: str) -> object:
        return self.metadata.get(f"{self.architecture}.{key}")


@dataclass(frozen=True, slots=True)
class GgufArchitecture:
    hf_config: Callable[[ArchitectureMetadata, bool], dict]  # (metadata, tie_word_embeddings) → config.json
    layer_tensors: Mapping[str, str]  # a block's GGUF tensor → the layer's HF tensor (without ".weight")
    layer_shapes: Callable[[Mapping], dict[str, tuple[int, ...]]]  # HF layer tensor → shape, from the config
    permuted_rotary: bool  # q/k rows permuted by llama.cpp (undone on the way back)
    norm_offset: float  # llama.cpp stored every norm weight plus this


def decoder_config(meta: ArchitectureMetadata, *, tie_word_embeddings: bool) -> dict:
    """The config fields every architecture reads alike."""
    hidden_size = int(meta.read("embedding_length"))
    num_heads = int(meta.read("attention.head_count"))
    head_dim = int(meta.read("attention.key_length", hidden_size // num_heads))
    value_dim = int(meta.read("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelLoadError(f"{meta.source}: value heads {value_dim} wide but key heads {head_dim} are not supported")
    rotary_dim = int(meta.read("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"{meta.source}: partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported"
        )
    tokens = meta.metadata.get("tokenizer.ggml.tokens")
    return {
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.read("feed_forward_length")),
        "num_hidden_layers": int(meta.read("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.read("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": shortest_float(meta.read("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.read("context_length")),
        "vocab_size": int(meta.read("vocab_size", len(tokens) if isinstance(tokens, list) else None)),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "bos_token_id": meta.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _rope_scaling(meta: ArchitectureMetadata, supported: tuple[str, ...]) -> dict | None:
    kind = meta.optional("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in supported:
        raise ModelLoadError(f"{meta.source}: rope scaling {kind!r} is not supported")
    return {"rope_type": kind, "factor": shortest_float(meta.read("rope.scaling.factor"))}


def llama_config(meta: ArchitectureMetadata, tie_word_embeddings: bool) -> dict:
    _rope_scaling(meta, supported=())
    rope_theta = shortest_float(meta.read("rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config(meta, tie_word_embeddings=tie_word_embeddings),
        "hidden_act": "silu",
        "mlp_bias": False,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
    }


def gemma3_config(meta: ArchitectureMetadata, tie_word_embeddings: bool) -> dict:
    config = decoder_config(meta, tie_word_embeddings=tie_word_embeddings)
    num_layers = config["num_hidden_layers"]
    full_rope = {"rope_type": "default", **(_rope_scaling(meta, supported=("linear",)) or {})}
    full_rope["rope_theta"] = shortest_float(meta.read("rope.freq_base", 1_000_000.0))
    query_scalar = config["head_dim"]
    if num_layers == GEMMA3_27B_LAYERS:
        query_scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_scalar,
        "sliding_window": int(meta.read("attention.sliding_window")),
        "layer_types": _gemma3_layer_types(meta, num_layers),
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        # Neither is in Gemma 3's GGUF files; a file that sets one keeps it (and the model refuses
        # attention softcapping by name).
        "final_logit_softcapping": meta.optional("final_logit_softcapping"),
        "attn_logit_softcapping": meta.optional("attn_logit_softcapping"),
    }


def _gemma3_layer_types(meta: ArchitectureMetadata, num_layers: int) -> list[str]:
    """Newer llama.cpp writes the pattern (every n-th layer global, or a bool per layer: true is
    sliding); older files leave it to llama.cpp's fixed 6."""
    pattern = meta.optional("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(
                f"{meta.source}: '{meta.architecture}.attention.sliding_window_pattern' has {len(pattern)} "
                f"entries for {num_layers} layers"
            )
        return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    every = int(pattern) if pattern else GEMMA3_SLIDING_WINDOW_PATTERN
    return ["full_attention" if (layer + 1) % every == 0 else "sliding_attention" for layer in range(num_layers)]


def llama_layer_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def gemma3_layer_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    return {
        **llama_layer_shapes(config),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "pre_feedforward_layernorm.weight": (hidden,),
        "post_feedforward_layernorm.weight": (hidden,),
    }


ARCHITECTURES = {
    "llama": GgufArchitecture(
        hf_config=llama_config,
        layer_tensors=LLAMA_LAYER_TENSORS,
        layer_shapes=llama_layer_shapes,
        permuted_rotary=True,
        norm_offset=0.0,
    ),
    "gemma3": GgufArchitecture(
        hf_config=gemma3_config,
        layer_tensors=GEMMA3_LAYER_TENSORS,
        layer_shapes=gemma3_layer_shapes,
        permuted_rotary=False,
        norm_offset=1.0,
    ),
}


def shortest_float(value: object) -> float:
    # GGUF stores float32; write what the original config said (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))
