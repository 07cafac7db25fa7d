"""A tiny Gemma 3 GGUF written the way llama.cpp writes one: norms stored as 1 + weight, q/k rows as
HF has them, a SentencePiece vocabulary (byte tokens, no merges) and no prefix space."""

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

# head_dim 256 as the real 270M: transformers' GGUF reader assumes query_pre_attn_scalar 256, llama.cpp
# (and our converter) take head_dim.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS, WINDOW = 64, 2, 1, 256, 96, 6, 4
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n", "  "]
BYTES = [f"<0x{byte:02X}>" for byte in range(256)]
# "th" is listed before "he": "the" merges t+h first.
NORMAL = ["▁", *"abcdefghijklmnopqrstuvwxyz", "th", "he", "▁t", "▁the", "in", "▁a"]
TOKEN_TYPES = {
    **dict.fromkeys(CONTROL, 3),
    **dict.fromkeys(USER_DEFINED, 4),
    **dict.fromkeys(BYTES, 6),
    **dict.fromkeys(NORMAL, 1),
}


@dataclass
class TinyGemma3:
    path: Path
    tokens: list[str]
    # Hugging Face name → the float32 values the converter must produce.
    expected_weights: dict[str, np.ndarray] = field(default_factory=dict)


def write_tiny_gemma3_gguf(path: Path) -> TinyGemma3:
    rng = np.random.default_rng(0)
    tokens = [*CONTROL, *USER_DEFINED, *BYTES, *NORMAL]
    tiny = TinyGemma3(path=path, tokens=tokens)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(index) for index in range(len(tokens))])
    writer.add_token_types([TOKEN_TYPES[token] for token in tokens])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    def random(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.3)

    def add(gguf_name: str, hf_name: str, values: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, values)
            tiny.expected_weights[hf_name] = values
        else:
            packed = quantize(values, kind)
            writer.add_tensor(gguf_name, packed, raw_dtype=kind)
            tiny.expected_weights[hf_name] = dequantize(packed, kind)

    def add_norm(gguf_name: str, hf_name: str, size: int) -> None:
        weight = random(size)
        # llama.cpp stores Gemma's norms as 1 + weight; reading back subtracts 1 in float32.
        writer.add_tensor(gguf_name, weight + np.float32(1))
        tiny.expected_weights[hf_name] = (weight + np.float32(1)) - np.float32(1)

    q8, q5, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", "model.embed_tokens.weight", random(len(tokens), HIDDEN), q8)
    add_norm("output_norm.weight", "model.norm.weight", HIDDEN)
    for layer in range(LAYERS):
        block, hf = f"blk.{layer}", f"model.layers.{layer}"
        add_norm(f"{block}.attn_norm.weight", f"{hf}.input_layernorm.weight", HIDDEN)
        add_norm(f"{block}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", HEAD_DIM)
        add_norm(f"{block}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", HEAD_DIM)
        add_norm(f"{block}.post_attention_norm.weight", f"{hf}.post_attention_layernorm.weight", HIDDEN)
        add_norm(f"{block}.ffn_norm.weight", f"{hf}.pre_feedforward_layernorm.weight", HIDDEN)
        add_norm(f"{block}.post_ffw_norm.weight", f"{hf}.post_feedforward_layernorm.weight", HIDDEN)
        add(f"{block}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", random(HEADS * HEAD_DIM, HIDDEN), q8)
        add(f"{block}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", random(KV_HEADS * HEAD_DIM, HIDDEN), f32)
        add(f"{block}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", random(KV_HEADS * HEAD_DIM, HIDDEN), q5)
        add(f"{block}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", random(HIDDEN, HEADS * HEAD_DIM), q5)
        add(f"{block}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", random(INTERMEDIATE, HIDDEN), q8)
        add(f"{block}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", random(INTERMEDIATE, HIDDEN), q8)
        add(f"{block}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", random(HIDDEN, INTERMEDIATE), q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny
