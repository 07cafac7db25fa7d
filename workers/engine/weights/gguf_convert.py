"""Converts a llama-architecture GGUF file into a Hugging Face-format model directory.

The directory holds float32 weights under Hugging Face tensor names (`model.safetensors`), a
`LlamaForCausalLM` `config.json`, `generation_config.json` and the tokenizer files. Callers write into
an empty temporary directory and move it into place themselves (see `loader`).
"""

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from workers.engine.weights.gguf_tokenizer import tokenizer_from_gguf
from workers.protocol.errors import ModelLoadError

# Bump workers.engine.weights.loader.CONVERTER_VERSION when the output changes, so that caches written by
# an older converter are rebuilt.
GGUF_MAGIC = b"GGUF"

GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSOR_NAMES = {
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

# llama.cpp permutes q rows per query head and k rows per key/value head.
ROTARY_HEAD_COUNT_KEYS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    reader = open_gguf(gguf_path)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tie_word_embeddings = all(tensor.name != "output.weight" for tensor in reader.tensors)
    # Metadata problems surface here, before the slow part.
    config = llama_config(metadata, tie_word_embeddings=tie_word_embeddings, source=gguf_path)
    tokenizer = tokenizer_from_gguf(metadata, source=gguf_path)
    weights = hf_weights(reader, config, source=gguf_path, progress=progress)

    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": list(tokenizer.end_of_generation_ids) or config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    (out_dir / "tokenizer.json").write_text(tokenizer.tokenizer_json, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer.tokenizer_config)


def hf_weights(reader: GGUFReader, config: Mapping, *, source: Path, progress: bool) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, un-permuted and renamed, checked against the config's shapes."""
    expected_shapes = hf_tensor_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"Converting {source.name}", unit="tensor", disable=not progress, file=sys.stderr)
    for tensor in bar:
        hf_name = hf_tensor_name(tensor.name, source=source)
        expected = expected_shapes.get(hf_name)
        if expected is None:
            raise ModelLoadError(f"{source}: unexpected tensor {tensor.name} for this config")
        weight = _dequantized(tensor, source=source)
        head_count_key = ROTARY_HEAD_COUNT_KEYS.get(tensor.name.split(".")[-2])
        if head_count_key is not None:
            weight = unpermute_rotary_rows(weight, config[head_count_key])
        if weight.shape != expected:
            raise ModelLoadError(f"{source}: tensor {tensor.name} has shape {weight.shape}, expected {expected}")
        weights[hf_name] = torch.from_numpy(weight)
    missing = sorted(set(expected_shapes) - set(weights))
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} tensors missing, such as {missing[0]}")
    return weights


def open_gguf(gguf_path: Path) -> GGUFReader:
    try:
        with gguf_path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise ModelLoadError(f"{gguf_path}: cannot read GGUF file: {error}") from error
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf_path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(gguf_path, "r")
    except (ValueError, IndexError, KeyError, OSError) as error:
        # GGUFReader reports a short file as a failed numpy reshape; say what it means.
        size = gguf_path.stat().st_size
        raise ModelLoadError(f"{gguf_path}: truncated or corrupt GGUF file ({size} bytes): {error}") from error


def llama_config(metadata: Mapping[str, object], *, tie_word_embeddings: bool, source: Path) -> dict:
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ModelLoadError(f"{source}: architecture {architecture!r} is not supported (supported: 'llama')")

    def read(key: str, default: object = None) -> object:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: metadata 'llama.{key}' is missing")
        return value

    rope_scaling = metadata.get("llama.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ModelLoadError(f"{source}: rope scaling {rope_scaling!r} is not supported")
    hidden_size = int(read("embedding_length"))
    num_heads = int(read("attention.head_count"))
    head_dim = int(read("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(read("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(f"{source}: partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(read("vocab_size", len(tokens) if isinstance(tokens, list) else None))
    rope_theta = _shortest_float(read("rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(read("feed_forward_length")),
        "num_hidden_layers": int(read("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(read("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float(read("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(read("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_tensor_shapes(config: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
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
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def hf_tensor_name(gguf_name: str, *, source: Path) -> str:
    if (match := re.fullmatch(r"(\w+)\.weight", gguf_name)) and match[1] in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[match[1]]}.weight"
    if (match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)) and match[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{match[1]}.{LAYER_TENSOR_NAMES[match[2]]}.weight"
    raise ModelLoadError(f"{source}: tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's converter, which reorders each head's q/k rows from Hugging Face's rotary
    layout (first half, second half) to interleaved pairs: GGUF row (head, j, s) is HF row (head, s, j)."""
    head_dim = weight.shape[0] // num_heads
    paired = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(paired.swapaxes(1, 2).reshape(weight.shape))


def _dequantized(tensor: ReaderTensor, *, source: Path) -> np.ndarray:
    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as error:
        raise ModelLoadError(
            f"{source}: cannot dequantize tensor {tensor.name} ({tensor.tensor_type.name}): {error}"
        ) from error
    # np.array copies: an F32 tensor would otherwise stay a view into the memory-mapped file.
    return np.array(weight, dtype=np.float32)


def _shortest_float(value: object) -> float:
    # GGUF stores float32; write what the original config said (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _write_json(path: Path, content: object) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
