"""An FP8-KV engine through the Triton attention kernels (without CUDA, in Triton's interpreter)
against the same engine through the torch reference backend: both read the same FP8 rows as the
same dequantized values, so their logits agree to float32 rounding, for full attention, sliding
windows and MLA's latent."""

import random

import pytest
import torch

pytest.importorskip("triton")

from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS  # noqa: E402
from tests.workers.engine.hf_reference import TINY_CONFIGS  # noqa: E402
from workers.engine import LLM, SamplingParams  # noqa: E402
from workers.protocol.engine_request import EngineRequest  # noqa: E402

MODELS = {
    "llama": TINY_CONFIGS["llama"],
    "sliding window": TINY_CONFIGS["qwen3_qknorm_layer_types"],
    "deepseek_v3": TINY_MOE_CONFIGS["deepseek_v3"],
}
PROMPT = [random.Random(1).randrange(3, 120) for _ in range(40)]


def prompt_logprobs_and_tokens(model: str, backend: str) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logprobs (prefilled in chunks of 16) and 6 greedy tokens (decode steps)."""
    engine = LLM(
        MODELS[model],
        seed=0,
        kv_cache_bytes=1 << 22,
        kv_cache_dtype="fp8",
        attention_backend=backend,
        max_num_batched_tokens=16,
    ).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=PROMPT, params=params, prompt_logprobs=0))
    entries, tokens = None, []
    while engine.has_unfinished():
        for delta in engine.step():
            entries = delta.prompt_logprobs or entries
            tokens += delta.token_ids
    return torch.tensor([entry.logprob for entry in entries[1:]]), tokens


@pytest.mark.parametrize("model", list(MODELS))
def test_triton_on_an_fp8_cache_matches_the_torch_backend(model):
    logprobs, tokens = prompt_logprobs_and_tokens(model, "triton")
    expected_logprobs, expected_tokens = prompt_logprobs_and_tokens(model, "torch_blockwise")
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-4)
    assert tokens == expected_tokens
