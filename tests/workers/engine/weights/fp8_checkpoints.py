"""Tiny checkpoints in DeepSeek-V3's FP8 format, written from HF models' random weights: every decoder
layer's projection (attention, dense and shared MLPs, routed experts, kv_b_proj included) saved as
e4m3 with its float32 `weight_scale_inv` per 128x128 tile beside it; embeddings, norms, routers and
lm_head as they are. The same weights dequantized make the float32 checkpoint they are checked against."""

import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.quant.fp8_blocks import dequantize_weight_blocks, quantize_weight_blocks
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from tests.workers.engine.hf_reference import build_hf_model_from

BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
# What DeepSeek-V3's checkpoint quantizes: every projection of a decoder layer, not the router (mlp.gate).
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?\w+_proj(_with_mqa)?\.weight")
# DeepSeek-V3 with one dense layer then MoE layers, MLPs and experts 128 wide so that every fused
# projection's parts (gate/up) end on a tile boundary: the checkpoint's tiles load as they are.
DEEPSEEK_V3 = {
    **TINY_MOE_CONFIGS["deepseek_v3"],
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 128,
    "moe_intermediate_size": 128,
}


def hf_weights(config: dict) -> dict[str, torch.Tensor]:
    """An HF model's random float32 weights as its checkpoint names them (per-expert tensors, as
    save_pretrained writes them), routers decisive (as hf_moe_reference builds them)."""
    model = build_hf_model_from(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.2)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return {
            name: tensor
            for path in sorted(Path(directory).glob("*.safetensors"))
            for name, tensor in load_file(path).items()
        }


def quantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors: each projection as e4m3 values plus its weight_scale_inv."""
    tensors = {}
    for name, tensor in weights.items():
        if QUANTIZED.fullmatch(name):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_weight_blocks(tensor, BLOCK)
        else:
            tensors[name] = tensor
    return tensors


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 checkpoint holding an FP8 checkpoint's real weights."""
    return {
        name: dequantize_weight_blocks(tensor, tensors[f"{name}_scale_inv"], BLOCK)
        if f"{name}_scale_inv" in tensors
        else tensor
        for name, tensor in tensors.items()
        if not name.endswith("_scale_inv")
    }


def write_checkpoint(
    directory: Path, config: dict, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None
) -> Path:
    """An HF directory: config.json (with `quantization_config` if given) and two safetensors shards,
    the scales in the second, so each e4m3 weight loads before its scale."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {**config, "torch_dtype": "float32"}
    if quantization_config is not None:
        fields["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(fields))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in tensors.items():
        shards[sorted(shards)[name.endswith("_scale_inv")]][name] = tensor
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory
