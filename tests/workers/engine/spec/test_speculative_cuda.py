"""Speculation on a CUDA device (run on the accelerator machine: `pytest -m gpu`), on the device path
(Triton attention, persistent input batch, on-device sampling), in float32: greedy tokens are those of
the same engine without speculation, in one batch that mixes stop strings, lengths ending inside
accepted runs, an abort, preemption, prefix hits and a grammar-constrained request; and in a batch of
40 requests that verify drafts together, under the fixed and the DSpark budgets."""

import json

import pytest
import torch

from tests.workers.engine.spec.test_speculation_budgets import CHEAP_DRAFTS
from tests.workers.engine.spec.test_speculative_engine import (
    CONFIG,
    SMOLLM2,
    WIDE_CONFIG,
    greedy,
    looping_params,
    repeating_prompts,
)
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import OutputConstraintSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SETTINGS = dict(device="cuda", dtype="float32", seed=0, max_model_len=256)
BUDGETS = {
    "fixed": dict(spec_budget="fixed"),
    "dspark": dict(spec_budget="dspark", cost_model=CHEAP_DRAFTS),
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}
# The tiny random model needs not close the object within max_tokens: its tokens are compared, not parsed.
ABORTED = "abort"


@pytest.fixture(autouse=True)
def exact_float32_matmuls(monkeypatch):
    # TF32 would round the two engines' differently shaped matmuls differently.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def engines(config: dict, budget: str, **settings) -> tuple[LLM, LLM]:
    """An engine without speculation and one with n-gram drafts under `budget`, otherwise alike."""
    return (
        LLM(config, **SETTINGS, **settings),
        LLM(config, **SETTINGS, spec_method="ngram", spec_max_draft_tokens=4, **BUDGETS[budget], **settings),
    )


def run(llm: LLM, requests: dict[str, EngineRequest], abort: str | None = None) -> dict[str, dict]:
    """Each request's tokens, finish reason and cached prompt tokens; `abort` is aborted once it has
    a few tokens (mid-run: it asks for many more)."""
    engine = llm.engine
    for request in requests.values():
        engine.add_request(request)
    results = {rid: {"tokens": [], "finish": None, "cached": 0} for rid in requests}
    while engine.has_unfinished():
        if abort is not None and results[abort]["finish"] is None and len(results[abort]["tokens"]) >= 3:
            results[abort]["finish"] = engine.abort_request(abort).finish_reason
        for delta in engine.step():
            result = results[delta.request_id]
            result["tokens"] += delta.token_ids
            result["cached"] = max(result["cached"], delta.num_cached_tokens)
            if delta.finished:
                result["finish"] = delta.finish_reason
    return results


def mixed_batch(tokenizer, stops: list[str], tag: str) -> dict[str, EngineRequest]:
    """Requests with every ending: lengths that end inside accepted runs, stop strings, one to abort,
    one prompt twice, and one whose output a JSON schema constrains."""
    colours = tokenizer.encode("Colours: red green blue red green blue red green blue")
    chat = [{"role": "user", "content": 'Copy this JSON: {"name": "Ada", "tags": ["a", "b"]}'}]
    json_prompt = tokenizer.encode(tokenizer.apply_chat_template(chat), allow_special=True)
    prompts = repeating_prompts(6, seed=7)
    requests = [
        *[(f"length-{i}", prompt, greedy(9 + 7 * i)) for i, prompt in enumerate(prompts)],
        ("stop-middle", colours, looping_params(tokenizer, 48, stop=[stops[0]])),
        ("stop-end", colours, looping_params(tokenizer, 48, stop=[stops[1]], include_stop_str_in_output=True)),
        ("looping", colours, looping_params(tokenizer, 48, ignore_eos=True)),
        (ABORTED, prompts[1], greedy(48)),
        ("again", prompts[0], greedy(30)),
    ]
    batch = {
        f"{tag}-{rid}": EngineRequest(request_id=f"{tag}-{rid}", prompt_token_ids=prompt, params=params)
        for rid, prompt, params in requests
    }
    batch[f"{tag}-json"] = EngineRequest(
        request_id=f"{tag}-json",
        prompt_token_ids=json_prompt,
        params=SamplingParams(temperature=0.0, max_tokens=40),
        constraint=OutputConstraintSpec("json", json.dumps(SCHEMA)),
    )
    return batch


def stop_strings(base: LLM) -> list[str]:
    """Two stop strings from the middle and the end of what the model writes, as in the CPU test."""
    tokenizer = base.tokenizer
    prompt = tokenizer.encode("Colours: red green blue red green blue red green blue")
    text = base.generate([prompt], looping_params(tokenizer, 48, ignore_eos=True))[0].text
    return [text[len(text) // 2 : len(text) // 2 + 9], text[-12:-3]]


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_a_mixed_batch_under_preemption_gives_the_tokens_without_speculation(budget):
    # 24 pages of 16 tokens for 12 requests of up to ~90 tokens: requests are preempted and recomputed.
    base, spec = engines(WIDE_CONFIG, budget, num_pages=24, max_num_batched_tokens=64, tokenizer=SMOLLM2)
    stops = stop_strings(base)
    # The second round resubmits the first's prompts: prefix hits on pages computed while speculating.
    expected = {
        **run(base, mixed_batch(base.tokenizer, stops, "one")),
        **run(base, mixed_batch(base.tokenizer, stops, "two")),
    }
    results = {
        **run(spec, mixed_batch(spec.tokenizer, stops, "one"), abort=f"one-{ABORTED}"),
        **run(spec, mixed_batch(spec.tokenizer, stops, "two")),
    }

    aborted = results.pop(f"one-{ABORTED}")
    full = expected.pop(f"one-{ABORTED}")
    assert aborted["finish"] == "abort"
    assert 0 < len(aborted["tokens"]) < 48 and aborted["tokens"] == full["tokens"][: len(aborted["tokens"])]
    mismatched = [
        rid
        for rid in expected
        if (results[rid]["tokens"], results[rid]["finish"]) != (expected[rid]["tokens"], expected[rid]["finish"])
    ]
    assert mismatched == []
    assert [results[f"{tag}-stop-{where}"]["finish"] for tag in ("one", "two") for where in ("middle", "end")] == [
        "stop"
    ] * 4
    assert [len(results[f"one-length-{i}"]["tokens"]) for i in range(6)] == [9 + 7 * i for i in range(6)]
    assert spec.tokenizer.decode(results["one-json"]["tokens"]).lstrip().startswith("{")  # the grammar held
    assert any(results[f"two-length-{i}"]["cached"] > 0 for i in range(6))
    spec_stats = spec.engine.stats()
    assert spec_stats.num_preemptions > 0
    assert spec_stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_forty_requests_verifying_together_give_the_tokens_without_speculation(budget):
    count = 40
    base, spec = engines(CONFIG, budget, kv_cache_bytes=1 << 26, max_num_seqs=count)
    prompts = repeating_prompts(count, seed=8)

    expected = base.generate(prompts, greedy(32))
    results = spec.generate(prompts, greedy(32))

    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    stats = spec.engine.stats()
    assert stats.spec_decode.num_accepted_tokens > 0
    # Steps verify drafts of many of the 40 requests at once (the small vocabulary's model repeats its
    # prompts, so most requests have drafts most steps).
    assert stats.spec_decode.num_drafts / stats.steps.num_steps > count / 5
