"""Converts a GGUF file (llama or gemma3 architecture; see gguf_architectures) into a Hugging
Face-format model directory.

The directory holds float32 weights under Hugging Face tensor names (`model.safetensors`), the
architecture's `config.json`, `generation_config.json` and the tokenizer files. Callers write into
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

from workers.engine.weights.gguf_architectures import ARCHITECTURES, ArchitectureMetadata, GgufArchitecture
from workers.engine.weights.gguf_tokenizer import tokenizer_from_gguf
from workers.protocol.errors import ModelLoadError

# Bump workers.engine.weights.loader.CONVERTER_VERSION when the output changes, so that caches written by
# an older converter are rebuilt.
GGUF_MAGIC = b"GGUF"

GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp permutes q rows per query head and k rows per key/value head.
ROTARY_HEAD_COUNT_KEYS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    reader = open_gguf(gguf_path)
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tie_word_embeddings = all(tensor.name != "output.weight" for tensor in reader.tensors)
    architecture_name = metadata.get("general.architecture")
    architecture = ARCHITECTURES.get(architecture_name)
    if architecture is None:
        raise ModelLoadError(
            f"{gguf_path}: architecture {architecture_name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    # Metadata problems surface here, before the slow part.
    config = architecture.hf_config(ArchitectureMetadata(metadata, architecture_name, gguf_path), tie_word_embeddings)
    tokenizer = tokenizer_from_gguf(metadata, source=gguf_path)
    weights = hf_weights(reader, architecture, config, source=gguf_path, progress=progress)

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


def hf_weights(
    reader: GGUFReader, architecture: GgufArchitecture, config: Mapping, *, source: Path, progress: bool
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, its llama.cpp changes undone, renamed, and checked against
    the config's shapes."""
    expected_shapes = hf_tensor_shapes(architecture, config)
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc=f"Converting {source.name}", unit="tensor", disable=not progress, file=sys.stderr)
    for tensor in bar:
        hf_name = hf_tensor_name(architecture, tensor.name, source=source)
        expected = expected_shapes.get(hf_name)
        if expected is None:
            raise ModelLoadError(f"{source}: unexpected tensor {tensor.name} for this config")
        weight = _dequantized(tensor, source=source)
        head_count_key = ROTARY_HEAD_COUNT_KEYS.get(tensor.name.split(".")[-2])
        if architecture.permuted_rotary and head_count_key is not None:
            weight = unpermute_rotary_rows(weight, config[head_count_key])
        if architecture.norm_offset and tensor.name.endswith("norm.weight"):
            weight -= np.float32(architecture.norm_offset)
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


def hf_tensor_shapes(architecture: GgufArchitecture, config: Mapping[str, object]) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = architecture.layer_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def hf_tensor_name(architecture: GgufArchitecture, gguf_name: str, *, source: Path) -> str:
    if (match := re.fullmatch(r"(\w+)\.weight", gguf_name)) and match[1] in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[match[1]]}.weight"
    layer_tensors = architecture.layer_tensors
    if (match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)) and match[2] in layer_tensors:
        return f"model.layers.{match[1]}.{layer_tensors[match[2]]}.weight"
    raise ModelLoadError(f"{source}: tensor {gguf_name!r} has no Hugging Face counterpart")


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


def _write_json(path: Path, content: object) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
