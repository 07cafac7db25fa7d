"""Builds a ready model (and its tokenizer) from a model name, a directory, or a bare config."""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.quant.fp8_blocks import FP8
from workers.engine.config import ModelConfig
from workers.engine.fp8_model import convert_to_fp8, finish_fp8_loading
from workers.engine.materialize import default_dtype, materialize
from workers.engine.models.decoder import DecoderForCausalLM
from workers.engine.models.mtp import MultiTokenPredictor
from workers.engine.models.registry import family_of
from workers.engine.weights import load_weights, resolve_model
from workers.engine.weights.loader import float8_tensor_names
from workers.engine.weights.quantization import pair_scales, served_format, weight_dtype_name
from workers.protocol.errors import ModelLoadError
from workers.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ModelSource = str | os.PathLike | dict[str, Any]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: DecoderForCausalLM
    tokenizer: Tokenizer | None
    max_model_len: int
    weight_dtype: str  # how its weights are stored: "bfloat16", "float32", "fp8_e4m3"... (EngineInfo reports it)


def load_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    seed: int,
    max_model_len: int | None,
    tokenizer: str | os.PathLike | None = None,
    quantization: str | None = None,
    with_mtp: bool = False,
) -> LoadedModel:
    """A model from a packaged name or HF directory (its weights), or from a config (random weights).

    A config is a dict, a path to a JSON file, or a directory holding only config.json; its
    weights are drawn from `seed`, which is how tests and GPU benchmarks build models offline.
    `quantization` ("fp8", EngineArgs.quantization) quantizes the weights at load; a checkpoint
    saved quantized (its config's quantization_config) is served as saved whatever it says.
    `with_mtp` also builds and loads the checkpoint's multi-token-prediction layers as the model's
    `mtp` (models.mtp; a speculative drafter's); without it they are skipped.
    """
    files = None
    if isinstance(source, dict):
        name, hf_config = str(source.get("_name_or_path") or "random"), source
    elif Path(source).is_file():
        name, hf_config = Path(source).stem, _read_json(Path(source))
    else:
        files = resolve_model(source)
        name, hf_config = files.name, files.config

    fmt = served_format(hf_config, quantization)
    family = family_of(hf_config)
    config = family.model_config(hf_config)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    length = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    checkpoint = files is not None and bool(files.weight_files)

    def build() -> DecoderForCausalLM:
        model = family.model_class(config, max_positions=length)
        if with_mtp:
            model.mtp = MultiTokenPredictor(model)
        return model

    # Parameters are made in their final dtype: made in float32 and cast, a 20B model's would need
    # twice its bf16 bytes at once (80 GB), more than an H100 holds.
    if fmt is None:
        with torch.device(device), default_dtype(dtype):
            model = build()
    else:
        # Built on meta and converted there, so the device never holds the float weights of its fp8
        # parts (DeepSeek-V3's 4 layers: 39 GB in fp8, 74 GB in bf16); they are quantized as they
        # load or are drawn, a tensor or chunk at a time.
        with torch.device("meta"), default_dtype(dtype):
            model = build()
        saved_fp8 = float8_tensor_names(files) if checkpoint and fmt.saved else None
        convert_to_fp8(model, fmt, saved_fp8=saved_fp8)
        materialize(model, device, dtype)
    if checkpoint:
        model.load_weights(pair_scales(load_weights(files), fmt))
    else:
        log.warning("model %s has no weights: using random weights (seed %d)", name, seed)
        model.init_random_weights(seed)
    # Parameters only: the rotary tables stay float32, as HF computes angles in float32. Weights held
    # in e4m3 stay so (their scales are float32 buffers).
    for param in model.parameters():
        if param.dtype != FP8:
            param.data = param.data.to(dtype)
    finish_fp8_loading(model, dtype)
    model.eval()
    if fmt is not None:
        log.info(
            "model %s: fp8 weights in %dx%d blocks (%s)",
            name,
            *fmt.block,
            "e4m3 on the device" if device.type == "cuda" else f"dequantized to {dtype} off CUDA",
        )

    if tokenizer is not None:
        loaded_tokenizer = Tokenizer.from_model_files(resolve_model(tokenizer))
    elif files is not None and files.tokenizer_file is not None:
        loaded_tokenizer = Tokenizer.from_model_files(files)
    else:
        loaded_tokenizer = None
    return LoadedModel(
        name=name,
        config=config,
        model=model,
        tokenizer=loaded_tokenizer,
        max_model_len=length,
        weight_dtype=weight_dtype_name(fmt, dtype),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read model config {path}: {error}") from None
