"""Speculation with DeepSeek-V3's MTP layer as the drafter (--spec-method mtp): the runner runs the
layer after each step and the next step verifies its chained drafts; the tokens are those of
decoding without speculation; a model without MTP layers is refused naming the setting. The layer's
weights are random here, so its drafts show the mechanics, not an acceptance rate."""

import random

import pytest
import torch

from kernels.attention import AttentionMetadata, get_backend
from tests.workers.engine.hf_moe_reference import TINY_MOE_CONFIGS
from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.protocol.errors import ModelLoadError

CONFIG = {**TINY_MOE_CONFIGS["deepseek_v3"], "num_nextn_predict_layers": 1}
SETTINGS = dict(seed=0, kv_cache_bytes=1 << 24, max_model_len=256)
PAGE = 16  # the engine's page size
CPU = torch.device("cpu")


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(CONFIG["vocab_size"]) for _ in range(9 + 4 * i)] for i in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_mtp_drafts_are_verified_and_the_tokens_are_the_target_s():
    base = LLM(CONFIG, **SETTINGS)
    spec = LLM(CONFIG, **SETTINGS, spec_method="mtp", spec_max_draft_tokens=3)

    expected = base.generate(prompts(4), greedy(20))
    results = spec.generate(prompts(4), greedy(20))

    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in expected]
    stats = spec.engine.stats().spec_decode
    assert stats.method == "mtp" and stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts


def test_mtp_asked_of_a_model_without_mtp_layers_is_refused_naming_the_setting():
    with pytest.raises(ModelLoadError, match=r"spec_method 'mtp'.*num_nextn_predict_layers"):
        LLM(TINY_CONFIGS["llama"], **SETTINGS, spec_method="mtp")


def recording_drafts(llm: LLM) -> dict[str, list[list[int]]]:
    """From now on, the MTP drafts the engine makes after each step, by request id, in order."""
    drafter = llm.engine.scheduler.speculator.drafter
    made: dict[str, list[list[int]]] = {}
    receive = drafter.receive

    def record(drafts):
        for request_id, draft in drafts.items():
            made.setdefault(request_id, []).append(draft.token_ids)
        receive(drafts)

    drafter.receive = record
    return made


def recorded_drafts(llm: LLM, prompt_list: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The MTP drafts made after each step of the first prompt's request, in order, and its tokens."""
    made = recording_drafts(llm)
    results = llm.generate(prompt_list, greedy(max_tokens))
    return made[f"{results[0].request_id}-0"], results[0].outputs[0].token_ids


def reference_drafts(llm: LLM, tokens: list[int], k: int) -> list[int]:
    """The MTP layer's greedy chain after `tokens`, computed in one pass over them with KV of its own:
    the main model's final hidden states at positions 0..n-2, the MTP layer over them with each next
    token, then k - 1 chained steps."""
    model = llm.engine.runner.model
    backend = get_backend("torch_blockwise")
    pages = 16
    kv = KVCache.for_model(model.config, num_pages=pages, page_size=PAGE, dtype=torch.float32, device=CPU)
    spec = model.mtp.kv_cache_spec(dtype=torch.float32, page_size=PAGE)
    latent = tuple(torch.zeros(spec.pages_shape(pages))[0].unbind(0))
    table = list(range(pages))

    def metadata(query_len: int, seq_len: int) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=[query_len], seq_lens=[seq_len], block_tables=[table], page_size=PAGE, device=CPU
        )

    known = torch.tensor(tokens)
    n = len(tokens) - 1
    with torch.no_grad():
        hidden = model(known[:n], torch.arange(n), kv.layers, [metadata(n, n)] * model.config.num_layers, backend)
        out = model.mtp(hidden, known[1:], torch.arange(n), latent, metadata(n, n), backend)[-1:]
        drafts = []
        for step in range(k):
            drafts.append(int(model.mtp.compute_logits(out).argmax(-1)))
            if step + 1 < k:
                position = torch.tensor([n + step + 1])
                out = model.mtp(out, torch.tensor(drafts[-1:]), position, latent, metadata(1, n + step + 2), backend)
    return drafts


def test_the_runner_s_mtp_drafts_are_the_layer_s_chain_over_the_request_s_tokens():
    spec = LLM(CONFIG, **SETTINGS, spec_method="mtp", spec_max_draft_tokens=3, max_num_batched_tokens=8)
    prompt = prompts(1)[0]

    made, output = recorded_drafts(spec, [prompt, *prompts(3)[1:]], 6)

    # after the prompt (in chunks of 8, batched with others) and its first token
    assert made[0] == reference_drafts(spec, [*prompt, output[0]], 3)
    # after the first decode step, which emitted the drafts it accepted and one more
    accepted = next((j for j, token in enumerate(made[0]) if token != output[1 + j]), 3)
    assert made[1] == reference_drafts(spec, [*prompt, *output[: 2 + accepted]], 3)
