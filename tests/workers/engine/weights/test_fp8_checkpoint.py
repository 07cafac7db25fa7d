"""FP8 block-scaled weights (DeepSeek-V3's checkpoint format) on the CPU: an FP8 checkpoint loads into
the same real weights as its dequantized copy and computes what the W8A8 kernel would; --quantization
fp8 quantizes a float checkpoint (or random weights) into the same format; what is not served is
refused by name.

Off CUDA the weights are dequantized at load, so an FP8 model differs from its dequantized copy only
in its linears' activations, quantized per token and 128 channels to e4m3 (3 mantissa bits: a
rounding error of at most 2^-4 of the value, about 2% on average). Summed over a dot product those
errors partly cancel: each linear's output is off by ~1-3% of its size, and the logits, through a
few layers, by a few percent. The bounds below (relative L2 error 0.1 of the logits for exact
weights, 0.15 where the weights are quantized too) leave that room, and catch a wrong scale or tile
(errors of order 1)."""

import pytest
import torch
from torch import nn

from kernels.attention import AttentionMetadata, get_backend
from kernels.quant.fp8_blocks import FP8, quantize_weight_blocks
from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.weights.fp8_checkpoints import (
    DEEPSEEK_V3,
    FP8_CONFIG,
    dequantized,
    hf_weights,
    quantized,
    write_checkpoint,
)
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.layers.fp8_linear import Fp8Linear
from workers.engine.model_loader import LoadedModel, load_model
from workers.engine.weights import load_weights, resolve_model
from workers.protocol.errors import ModelLoadError

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def load(source, **options) -> LoadedModel:
    return load_model(source, device=CPU, dtype=torch.float32, seed=0, max_model_len=256, **options)


def prefill_logits(loaded: LoadedModel, length: int = 40, device: torch.device = CPU) -> torch.Tensor:
    config = loaded.config
    dtype = loaded.model.embed_tokens.weight.dtype
    tokens = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).to(device)
    kv = KVCache.for_model(config, num_pages=4, page_size=16, dtype=dtype, device=device)
    metadata = AttentionMetadata.build(
        query_lens=[length], seq_lens=[length], block_tables=[[0, 1, 2]], page_size=16, device=device
    )
    backend = get_backend("torch_blockwise")
    positions = torch.arange(length, device=device)
    with torch.no_grad():
        hidden = loaded.model(tokens, positions, kv.layers, [metadata] * config.num_layers, backend)
        return loaded.model.compute_logits(hidden).cpu()


@pytest.fixture(scope="module")
def deepseek_checkpoints(tmp_path_factory):
    """(FP8 checkpoint, its dequantized float32 copy) of one tiny DeepSeek-V3."""
    tensors = quantized(hf_weights(DEEPSEEK_V3))
    root = tmp_path_factory.mktemp("deepseek")
    fp8 = write_checkpoint(root / "fp8", DEEPSEEK_V3, tensors, FP8_CONFIG)
    return fp8, write_checkpoint(root / "dequantized", DEEPSEEK_V3, dequantized(tensors))


@pytest.fixture(scope="module")
def llama_weights():
    return hf_weights(TINY_CONFIGS["llama"])


def test_an_fp8_deepseek_v3_checkpoint_loads_its_real_weights_into_fp8_linears(deepseek_checkpoints):
    fp8, dequantized_copy = deepseek_checkpoints
    ours, reference = load(fp8), load(dequantized_copy)
    linears = [name for name, module in ours.model.named_modules() if isinstance(module, Fp8Linear)]
    reference_params = reference.model.state_dict()

    assert ours.weight_dtype == "fp8_e4m3" and reference.weight_dtype == "float32"
    assert {name.rsplit(".", 1)[1] for name in linears} == {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    # kv_b_proj (used absorbed), routers, norms, embeddings and lm_head stay unquantized.
    assert type(ours.model.layers[0].self_attn.kv_b_proj) is nn.Linear
    for name, param in ours.model.state_dict().items():
        assert torch.equal(param, reference_params[name]), name


def test_fp8_deepseek_v3_logits_are_the_dequantized_models_within_activation_quantization(deepseek_checkpoints):
    fp8, dequantized_copy = deepseek_checkpoints
    ours, reference = prefill_logits(load(fp8)), prefill_logits(load(dequantized_copy))

    assert 0 < relative_error(ours, reference) < 0.1


def test_fp8_deepseek_v3_generates_the_dequantized_models_greedy_tokens(deepseek_checkpoints):
    fp8, dequantized_copy = deepseek_checkpoints
    ours = LLM(fp8, seed=0, kv_cache_bytes=1 << 22).generate([PROMPT], GREEDY)[0]
    reference = LLM(dequantized_copy, seed=0, kv_cache_bytes=1 << 22).generate([PROMPT], GREEDY)[0]

    assert ours.token_ids == reference.token_ids


def test_quantization_fp8_quantizes_a_float_checkpoint_into_the_checkpoints_own_tiles(deepseek_checkpoints):
    # Requantizing dequantized tiles finds the same largest value, so the same scale and e4m3 values
    # (up to a float32 rounding of the scale).
    fp8, dequantized_copy = deepseek_checkpoints
    saved = load(fp8).model.state_dict()
    quantized_at_load = load(dequantized_copy, quantization="fp8")

    assert quantized_at_load.weight_dtype == "fp8_e4m3"
    for name, param in quantized_at_load.model.state_dict().items():
        torch.testing.assert_close(param, saved[name], rtol=1e-6, atol=0, msg=name)


def test_a_checkpoint_saved_in_fp8_is_served_as_saved_whatever_quantization_says(deepseek_checkpoints):
    fp8, _ = deepseek_checkpoints
    saved = load(fp8).model.state_dict()
    asked = load(fp8, quantization="fp8").model.state_dict()

    assert all(torch.equal(param, saved[name]) for name, param in asked.items())


def test_llama_with_quantization_fp8_generates_and_its_logits_are_close_to_float32s():
    config = TINY_CONFIGS["llama"]
    ours, reference = load(config, quantization="fp8"), load(config)
    llm = LLM(config, seed=0, kv_cache_bytes=1 << 22, quantization="fp8")
    result = llm.generate([PROMPT], GREEDY)[0]

    assert isinstance(ours.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert 0 < relative_error(prefill_logits(ours), prefill_logits(reference)) < 0.15
    assert len(result.token_ids) == GREEDY.max_tokens
    unquantized = LLM(config, seed=0, kv_cache_bytes=1 << 22).engine.info
    assert llm.engine.info.weight_dtype == "fp8_e4m3" and unquantized.weight_dtype == "float32"
    # KV computed by fp8 weights is another model's: a store or handoff never mixes the two.
    assert llm.engine.info.kv_model_id != unquantized.kv_model_id


def test_llama_fp8_checkpoint_with_unaligned_q_k_v_loads_them_requantized_as_one(tmp_path, llama_weights):
    # q, k and v are 64, 32 and 32 rows: their tiles straddle the fused qkv_proj's parts, which is
    # therefore assembled and quantized as a whole, as --quantization fp8 quantizes it.
    config = TINY_CONFIGS["llama"]
    fp8 = load(write_checkpoint(tmp_path / "fp8", config, quantized(llama_weights), FP8_CONFIG))
    at_load = load(
        write_checkpoint(tmp_path / "float", config, dequantized(quantized(llama_weights))), quantization="fp8"
    )
    layer = fp8.model.layers[0].self_attn.qkv_proj
    expected = at_load.model.layers[0].self_attn.qkv_proj

    assert isinstance(layer, Fp8Linear)
    torch.testing.assert_close(layer.weight, expected.weight, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"weight_block_size": [128, 0]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ],
)
def test_unserved_quantization_configs_are_refused_naming_the_field(change, field):
    config = {**TINY_CONFIGS["llama"], "quantization_config": {**FP8_CONFIG, **change}}

    with pytest.raises(ModelLoadError, match=field):
        load(config)


def test_a_missing_scale_is_refused_naming_it(tmp_path, llama_weights):
    tensors = quantized(llama_weights)
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    directory = write_checkpoint(tmp_path, TINY_CONFIGS["llama"], tensors, FP8_CONFIG)

    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_inv"):
        load(directory)


def test_a_scale_of_the_wrong_shape_is_refused_naming_it(tmp_path, llama_weights):
    tensors = quantized(llama_weights)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 1)
    directory = write_checkpoint(tmp_path, TINY_CONFIGS["llama"], tensors, FP8_CONFIG)

    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv.*\(2, 1\)"):
        load(directory)


def test_e4m3_tensors_without_a_quantization_config_are_refused(tmp_path, llama_weights):
    directory = write_checkpoint(tmp_path, TINY_CONFIGS["llama"], quantized(llama_weights))

    with pytest.raises(ModelLoadError, match="quantization_config"):
        load(directory)


def test_modules_to_not_convert_stay_in_the_models_dtype(tmp_path, llama_weights):
    tensors = quantized(llama_weights)
    kept = "model.layers.0.self_attn.o_proj"
    del tensors[f"{kept}.weight_scale_inv"]
    tensors[f"{kept}.weight"] = llama_weights[f"{kept}.weight"]
    config = {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", kept, "model.layers.1.self_attn.k_proj"]}
    loaded = load(write_checkpoint(tmp_path, TINY_CONFIGS["llama"], tensors, config))
    layers = loaded.model.layers

    assert type(layers[0].self_attn.o_proj) is nn.Linear
    assert torch.equal(layers[0].self_attn.o_proj.weight, llama_weights[f"{kept}.weight"])
    # One part of layer 1's fused qkv_proj is not converted: the whole projection is held unquantized,
    # its e4m3 parts dequantized.
    assert type(layers[1].self_attn.qkv_proj) is nn.Linear
    assert isinstance(layers[1].self_attn.o_proj, Fp8Linear)


def test_the_safetensors_reader_passes_e4m3_through_untouched(tmp_path, llama_weights):
    name = "model.layers.0.mlp.up_proj.weight"
    values, _ = quantize_weight_blocks(llama_weights[name], (128, 128))
    directory = write_checkpoint(tmp_path, TINY_CONFIGS["llama"], quantized(llama_weights), FP8_CONFIG)

    read = dict(load_weights(resolve_model(directory)))

    assert read[name].dtype == FP8 and torch.equal(read[name].view(torch.uint8), values.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_fp8_deepseek_v3_keeps_e4m3_and_computes_what_the_cpu_models(deepseek_checkpoints):
    # The CPU model is the kernels' reference in float32, and so is the GPU run: what differs is the
    # tensor cores' shorter FP8 sums, which now and then move a value across an e4m3 rounding boundary
    # where the next layer quantizes it (bf16 activations on this 64-wide model moved the logits 5.6%;
    # float32 ones moved them 2.02% on an H100, so the bound leaves room for such a crossing or two).
    fp8, _ = deepseek_checkpoints
    cuda = torch.device("cuda")
    on_cuda = load_model(fp8, device=cuda, dtype=torch.float32, seed=0, max_model_len=256)
    experts = on_cuda.model.layers[1].mlp.experts

    assert on_cuda.model.layers[0].self_attn.o_proj.weight.dtype == FP8 and experts.w13.dtype == FP8
    assert relative_error(prefill_logits(on_cuda, device=cuda).float(), prefill_logits(load(fp8))) < 0.03
