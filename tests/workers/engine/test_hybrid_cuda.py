"""Hybrid-attention models on a CUDA device (`pytest -m gpu` on the accelerator machine): gpt-oss (sinks,
alternating windowed and full layers) and Gemma 3 against the CPU's reference path, through the
Triton kernels and the CUDA graphs of several KV groups; window replays of local and store hits as the
reference backend replays them."""

import pytest
import torch

from tests.workers.engine.hf_gpt_oss_reference import build_hf_gpt_oss
from tests.workers.engine.hf_reference import build_hf_model_from
from tests.workers.engine.test_gemma3_mistral import GEMMA3
from tests.workers.engine.test_window_replay import GREEDY, hybrid_llm, prompt
from workers.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HF_MODELS = {"gpt_oss": build_hf_gpt_oss, "gemma3_hybrid": lambda: build_hf_model_from(GEMMA3)}
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 100)), [(i * 7) % 128 for i in range(23)]]


@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_float32_greedy_of_a_hybrid_model_on_cuda_follows_the_cpu(name, eager, tmp_path):
    """The same checkpoint on the GPU (Triton kernels, sinks, per-group tables in CUDA graphs) and on
    the CPU's reference path, which the CPU suite checks against HF. HF itself is no reference here:
    the accelerator machine's transformers is another version, whose gpt-oss decodes other tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    HF_MODELS[name]().save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(
            tmp_path,
            device=device,
            dtype="float32",
            kv_cache_bytes=1 << 26,
            max_num_batched_tokens=32,
            enforce_eager=eager,
        )
        if device == "cuda":
            assert (llm.engine.runner.graphs is None) == eager
            assert len(llm.engine.runner.kv_cache.specs.groups) > 1  # a full group and a window group
        outputs[device] = [result.token_ids for result in llm.generate(PROMPTS, params)]
        llm.close()
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_a_local_hit_replays_its_windows_on_cuda_as_the_reference_backend_does(mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    first, other = prompt(50, seed=1), prompt(50, seed=2)
    outputs, replays = [], []
    for backend in ("torch_blockwise", "triton"):
        llm = hybrid_llm(
            "qwen3_qknorm_layer_types",
            swa_replay=mode,
            attention_backend=backend,
            page_size=8,
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
        )
        llm.generate([first], GREEDY)
        llm.generate([other], GREEDY)  # reuses the window pages of `first`, not its full ones
        outputs.append(llm.generate([first], GREEDY)[0].token_ids)
        replays.append(llm.engine.stats().swa)
        llm.close()

    assert outputs[0] == outputs[1] and replays[0] == replays[1]
    assert replays[1].replays == 1


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_a_store_hit_of_a_hybrid_model_replays_on_cuda_as_the_reference_backend_does(mode, tmp_path):
    """The same store hit through the Triton kernels and the reference backend (random weights differ
    between the CPU and CUDA, so both run on the GPU): the same tokens and the same replay."""
    torch.backends.cuda.matmul.allow_tf32 = False
    tokens = prompt(100, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outcomes = []
    for backend in ("torch_blockwise", "triton"):
        options = dict(
            kv_store=tmp_path / backend,
            kv_block_tokens=32,
            swa_replay=mode,
            page_size=8,
            attention_backend=backend,
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
        )
        writer = hybrid_llm("qwen3_qknorm_layer_types", **options)
        writer.generate([tokens[:90]], params)  # stores the prompt's first 2 blocks
        writer.close()
        reader = hybrid_llm("qwen3_qknorm_layer_types", **options)
        result = reader.generate([tokens], params)[0]
        swa = reader.engine.stats().swa
        reader.close()
        outcomes.append((result.num_cached_tokens, result.token_ids, swa.replayed_tokens, swa.state_misses))

    assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] == 32 and outcomes[1][3] == 1
