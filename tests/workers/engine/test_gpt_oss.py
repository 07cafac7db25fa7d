"""gpt-oss against Hugging Face transformers on the same tiny random weights, loaded from a saved
checkpoint directory: prefill logits on both torch backends, greedy generation through the engine
(chunked prefill, a prefix-cache hit), and bad configs and checkpoints refused by name."""

import importlib.util

import pytest
import torch

from kernels.attention import TORCH_BACKENDS, AttentionMetadata, get_backend
from tests.workers.engine.hf_gpt_oss_reference import TINY_GPT_OSS, build_hf_gpt_oss
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.model_loader import load_model
from workers.engine.models.gpt_oss import ClampedSwigluExperts
from workers.engine.models.registry import model_config
from workers.engine.weights import load_weights, resolve_model
from workers.protocol.errors import ModelLoadError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    model = build_hf_gpt_oss()
    directory = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(directory)
    return model, directory


def test_config_reads_as_hf_defines_it():
    config = model_config(TINY_GPT_OSS)
    assert config.layer_windows == (8, None, 8, None)
    assert config.attention_bias and config.moe.sparse_layers == (True,) * 4
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 32)
    assert (config.moe.swiglu_limit, config.moe.swiglu_alpha) == (1.5, 1.702)
    assert config.rope.kind == "yarn" and config.rope.truncate is False and config.rope.theta == 150000.0


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_prefill_logits_match_hf(hf_checkpoint, backend):
    hf_model, directory = hf_checkpoint
    loaded = load_model(directory, device=CPU, dtype=torch.float32, seed=0, max_model_len=256)
    config, model = loaded.config, loaded.model
    tokens = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    kv = KVCache.for_model(config, num_pages=5, page_size=16, dtype=torch.float32, device=CPU)
    metadata = AttentionMetadata.build(
        query_lens=[45], seq_lens=[45], block_tables=[[3, 1, 4]], page_size=16, device=CPU
    )
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        ours = model.compute_logits(
            model(tokens, torch.arange(45), kv.layers, [metadata] * config.num_layers, get_backend(backend))
        )
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        return hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()


# The torch reference path, and the device path (Triton attention with sinks, fused ops; under
# Triton's interpreter on the CPU).
@pytest.mark.parametrize(
    "backend",
    [
        "torch_blockwise",
        pytest.param("triton", marks=pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="no triton")),
    ],
)
def test_greedy_generation_matches_hf_generate_with_chunks_and_a_prefix_hit(hf_checkpoint, backend):
    hf_model, directory = hf_checkpoint
    llm = LLM(directory, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16, attention_backend=backend)
    shared = list(range(40, 75))
    prompts = [shared + [3, 14], shared + [15, 92, 65]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompts[0]], params)[0]
    second = llm.generate([prompts[1]], params)[0]  # chunked prefill of the prompts (16 tokens a step)
    assert second.num_cached_tokens == 32  # the shared prompt's two full pages of 16
    assert first.token_ids == hf_greedy(hf_model, prompts[0], 8)
    assert second.token_ids == hf_greedy(hf_model, prompts[1], 8)


def test_graph_safe_experts_agree_with_the_routed_ones():
    """The every-expert path (taken inside a CUDA graph capture) computes what the routed one does."""
    torch.manual_seed(0)
    experts = ClampedSwigluExperts(4, 16, 8, limit=1.0, alpha=1.702)
    for param in experts.parameters():
        param.data.normal_(0.0, 0.5)
    hidden = torch.randn(7, 16)
    topk_ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1], [0, 1], [2, 3], [1, 2]])
    topk_weights = torch.rand(7, 2).softmax(dim=-1)
    routed = experts(hidden, topk_ids, topk_weights)
    torch.testing.assert_close(experts.forward_every_expert(hidden, topk_ids, topk_weights), routed)
    assert routed.abs().min() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]},
            r"unsupported layer types \['chunked_attention'\]",
        ),
        ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
        ({"sliding_window": None}, "sliding_window is not set"),
        ({"swiglu_limit": None}, "swiglu_limit must be a finite number, got None"),
        ({"swiglu_limit": -1.0}, "swiglu_limit must be a positive number"),
        ({"swiglu_alpha": "fast"}, "swiglu_alpha must be a finite number"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok must be in \[1, 4\]"),
        ({"num_local_experts": 0}, "at least one expert"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config: mxfp4"),
        ({"quantization_config": "fp8"}, "quantization_config: fp8"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "unsupported rope scaling type 'longrope'"),
    ],
)
def test_bad_configs_are_refused_by_name(change, message):
    with pytest.raises(ModelLoadError, match=message):
        model_config({**TINY_GPT_OSS, **change})


def test_missing_fields_take_hf_defaults():
    bare = {k: v for k, v in TINY_GPT_OSS.items() if k not in ("swiglu_limit", "rope_parameters", "layer_types")}
    config = model_config(bare)
    assert config.moe.swiglu_limit == 7.0
    assert config.layer_windows == (8, None, 8, None)
    assert (config.rope.kind, config.rope.factor, config.rope.original_max_position_embeddings) == ("yarn", 32.0, 4096)


def test_bad_checkpoint_tensors_are_refused_by_name(hf_checkpoint):
    _, directory = hf_checkpoint
    loaded = load_model(directory, device=CPU, dtype=torch.float32, seed=0, max_model_len=256)
    tensors = list(load_weights(resolve_model(directory)))
    name = "model.layers.2.mlp.experts.down_proj"
    reshaped = [(n, t.transpose(1, 2) if n == name else t) for n, t in tensors]
    with pytest.raises(ModelLoadError, match=f"'{name}' has shape \\(4, 64, 32\\), expected \\(4, 32, 64\\)"):
        loaded.model.load_weights(reshaped)
    dropped = "model.layers.1.self_attn.sinks"
    with pytest.raises(ModelLoadError, match=f"checkpoint lacks 1 tensors, e.g. \\['{dropped}'\\]"):
        loaded.model.load_weights((n, t) for n, t in tensors if n != dropped)
