"""Loading an FP8 model (random weights or a float checkpoint with --quantization fp8, or a checkpoint
saved in FP8) never holds its float weights: the model is built on meta, converted there, and its fp8
parts are quantized as they load or are drawn. Random fp8 weights are the unquantized model's values
quantized, the same for a seed.

The memory test counts the bytes of every CPU tensor storage alive during the load (a dispatch mode
sees each op's outputs; a storage's Python object lives as long as the storage, so a finalizer on it
says when it is freed). It stops at finish_fp8_loading, where off CUDA the fp8 weights are dequantized
into the model's dtype for the reference path: up to there the CPU holds what a GPU would, e4m3
weights with their scales and the unquantized rest. Building the model in bf16 first, as loads did
before, holds at least the bf16 model: 40 MB here, against 20 MB for the fp8 one."""

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels.quant.fp8_blocks import SEARCHED_SCALE_FACTORS, dequantize_weight_blocks, quantize_weight_blocks
from tests.workers.engine.hf_idefics3_reference import TINY_IDEFICS3
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from tests.workers.engine.hf_reference import TINY, TINY_CONFIGS
from tests.workers.engine.weights.fp8_checkpoints import FP8_CONFIG, hf_weights, quantized
from workers.engine import model_loader
from workers.engine.layers import fp8_random
from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.layers.moe import RoutedExperts
from workers.engine.materialize import materialize
from workers.engine.model_loader import LoadedModel, load_model

CPU = torch.device("cpu")
BLOCK = (128, 128)
# Experts dominate: 3 MoE layers of 32 experts 256 x 256, bf16 40 MB, fp8 20 MB.
MOE = {
    **TINY_MOE_CONFIGS["deepseek_v3"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "n_routed_experts": 32,
    "first_k_dense_replace": 1,
}
TINY_FAMILIES = {
    "llama": TINY_CONFIGS["llama"],
    "deepseek_v3": {**TINY_MOE_CONFIGS["deepseek_v3"], "num_nextn_predict_layers": 1},
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], **TINY, head_dim=16),
    "idefics3": {**TINY_IDEFICS3, "architectures": ["Idefics3ForConditionalGeneration"]},
}
# What a load may hold besides the fp8 model, with random weights drawn in 1 MiB chunks (what the
# draws and quantization of a chunk take, several float32 copies of it) or a checkpoint tensor at a time.
CHUNK_BYTES = 1 << 20
WORKING_SET_BYTES = 8 * CHUNK_BYTES


class LiveStorageBytes(TorchDispatchMode):
    """The bytes of CPU tensor storages alive, and their peak, while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if id(storage) not in self._sizes:
                    self._sizes[id(storage)] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, id(storage))
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


def load(source, **options) -> LoadedModel:
    options = {"dtype": torch.bfloat16, "seed": 0, **options}
    return load_model(source, device=CPU, max_model_len=64, **options)


def write_one_shard(directory: Path, config: dict, tensors: dict[str, torch.Tensor], quantization=None) -> Path:
    """An HF directory of one shard: each e4m3 weight beside its scale, as a reader streams them."""
    directory.mkdir()
    fields = {**config, **({"quantization_config": quantization} if quantization else {})}
    (directory / "config.json").write_text(json.dumps(fields))
    save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """{kind: directory} of MOE's weights: bf16, and saved in FP8."""
    weights = hf_weights(MOE)
    root = tmp_path_factory.mktemp("moe")
    bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    return {
        "float checkpoint": write_one_shard(root / "bf16", MOE, bf16),
        "fp8 checkpoint": write_one_shard(root / "fp8", MOE, quantized(weights), FP8_CONFIG),
    }


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("source", ["random weights", "float checkpoint", "fp8 checkpoint"])
def test_an_fp8_load_holds_the_fp8_model_and_a_bounded_working_set_never_the_bf16_model(
    source, moe_checkpoints, monkeypatch
):
    bf16_model = model_bytes(load(MOE).model)
    monkeypatch.setattr(fp8_random, "RANDOM_CHUNK_BYTES", CHUNK_BYTES)
    live = LiveStorageBytes()
    at_finish = {}
    finish = model_loader.finish_fp8_loading

    def measured_finish(model: nn.Module, dtype: torch.dtype) -> None:
        at_finish.update(peak=live.peak, fp8_model=live.live)
        finish(model, dtype)

    monkeypatch.setattr(model_loader, "finish_fp8_loading", measured_finish)
    with live:
        load(MOE if source == "random weights" else moe_checkpoints[source], quantization="fp8")

    assert at_finish["fp8_model"] < 0.55 * bf16_model
    assert at_finish["peak"] - at_finish["fp8_model"] < WORKING_SET_BYTES
    assert at_finish["peak"] < 0.8 * bf16_model


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_fp8_weights_are_the_unquantized_models_quantized(family, dtype):
    config = TINY_FAMILIES[family]
    mtp = "num_nextn_predict_layers" in config
    ours = load(config, quantization="fp8", dtype=dtype, with_mtp=mtp).model
    reference = load(config, dtype=dtype, with_mtp=mtp).model
    reference_state = {**reference.state_dict(), **dict(reference.named_buffers())}
    quantized_names = set()
    for name, module in ours.named_modules():
        weights = {Fp8Linear: ("weight",), RoutedExperts: ("w13", "w2")}.get(type(module), ())
        for weight in weights:
            quantized_names.add(f"{name}.{weight}")
            reference = reference_state[f"{name}.{weight}"]
            searched = quantize_weight_blocks(reference, BLOCK, scale_factors=SEARCHED_SCALE_FACTORS)
            expected = dequantize_weight_blocks(*searched, BLOCK)
            assert torch.equal(getattr(module, weight), expected.to(dtype)), f"{name}.{weight}"

    assert quantized_names
    # Everything else, buffers computed at construction included, is the unquantized model's.
    for name, tensor in {**ours.state_dict(), **dict(ours.named_buffers())}.items():
        if name not in quantized_names:
            assert torch.equal(tensor, reference_state[name]), name


def test_random_fp8_weights_drawn_in_chunks_are_the_same_on_the_cpu_and_per_seed(monkeypatch):
    whole = load(MOE, quantization="fp8").model.state_dict()
    # Experts (512 KiB in float32) one at a time, the dense MLP's projections in blocks of 128 or 256 rows.
    monkeypatch.setattr(fp8_random, "RANDOM_CHUNK_BYTES", 256 << 10)
    chunked = load(MOE, quantization="fp8").model.state_dict()
    other_seed = load(MOE, quantization="fp8", seed=1).model.state_dict()

    for name, tensor in whole.items():
        assert torch.equal(chunked[name], tensor), name
    assert not torch.equal(other_seed["layers.1.mlp.experts.w13"], whole["layers.1.mlp.experts.w13"])


def test_an_fp8_load_refuses_a_module_whose_buffer_it_cannot_compute_again():
    class Uncomputed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Uncomputed())

    with pytest.raises(RuntimeError, match=r"\['1\.table'\].*init_buffers"):
        materialize(model, CPU, torch.float32)
