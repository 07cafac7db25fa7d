"""Fixtures: a tiny llama GGUF written with the gguf package (fast), and the real SmolLM2 model (slow)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from tokenizers import pre_tokenizers

from workers.engine.weights.gguf_convert import convert_gguf

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (LlamaModel.permute)."""
    half_head = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half_head, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass
class TinyGguf:
    path: Path
    tokens: list[str]
    # Hugging Face name → the float32 values the converter must produce (quantized ones after a round trip).
    expected_weights: dict[str, np.ndarray] = field(default_factory=dict)


def tiny_tokens() -> list[str]:
    """The special tokens, one token per byte (GPT-2's byte-level spelling), then three merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [byte for byte in range(256) if byte not in printable]
    byte_chars = [chr(byte) if byte in printable else chr(256 + unprintable.index(byte)) for byte in range(256)]
    assert set(byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())
    return [*SPECIAL_TOKENS, *byte_chars, "Ġt", "he", "Ġthe"]


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    extra_tensor: str | None = None,
) -> TinyGguf:
    rng = np.random.default_rng(0)
    tokens = tiny_tokens()
    tiny = TinyGguf(path=path, tokens=tokens)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(gguf_name: str, hf_name: str, values: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, values)
            tiny.expected_weights[hf_name] = values
        else:
            packed = quantize(values, kind)
            writer.add_tensor(gguf_name, packed, raw_dtype=kind)
            tiny.expected_weights[hf_name] = dequantize(packed, kind)

    def random(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    q8, q4, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    add("token_embd.weight", "model.embed_tokens.weight", random(len(tokens), HIDDEN), q8)
    add("output_norm.weight", "model.norm.weight", random(HIDDEN), f32)
    for layer in range(LAYERS):
        prefix, hf = f"blk.{layer}", f"model.layers.{layer}"
        add(f"{prefix}.attn_norm.weight", f"{hf}.input_layernorm.weight", random(HIDDEN), f32)
        add(f"{prefix}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", random(HIDDEN), f32)
        # q and k are stored the way llama.cpp stores them: rows permuted, in F32 so the check is exact.
        hf_q, hf_k = random(HEADS * HEAD_DIM, HIDDEN), random(KV_HEADS * HEAD_DIM, HIDDEN)
        writer.add_tensor(f"{prefix}.attn_q.weight", llama_cpp_permute(hf_q, HEADS))
        writer.add_tensor(f"{prefix}.attn_k.weight", llama_cpp_permute(hf_k, KV_HEADS))
        tiny.expected_weights[f"{hf}.self_attn.q_proj.weight"] = hf_q
        tiny.expected_weights[f"{hf}.self_attn.k_proj.weight"] = hf_k
        add(f"{prefix}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", random(KV_HEADS * HEAD_DIM, HIDDEN), q4)
        add(f"{prefix}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", random(HIDDEN, HEADS * HEAD_DIM), q4)
        add(f"{prefix}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", random(INTERMEDIATE, HIDDEN), q4)
        add(f"{prefix}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", random(INTERMEDIATE, HIDDEN), q4)
        add(f"{prefix}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", random(HIDDEN, INTERMEDIATE), q4)
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, random(HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGguf:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture
def tiny_gguf_factory(tmp_path: Path) -> Callable[..., TinyGguf]:
    return lambda **overrides: write_tiny_gguf(tmp_path / "variant.gguf", **overrides)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: TinyGguf) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    convert_gguf(tiny_gguf.path, directory, progress=False)
    return directory
