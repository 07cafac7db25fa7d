"""A mixed workload for comparing two engines' tokens: greedy and seeded rows, some with penalties,
logit bias and logprobs, stop tokens, several max_tokens, an abort mid-stream, shared prefixes
(prefix-cache hits) and, with few pages, preemption."""

import random

import msgspec

from workers.engine.engine import LLMEngine
from workers.protocol.engine_request import EngineRequest
from workers.protocol.sampling_params import SamplingParams

ABORTED = "abort-me"


def mixed_requests(
    vocab: int, *, count: int = 12, seed: int = 0, max_new: tuple[int, int] = (8, 24)
) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    requests = []
    for index in range(count):
        prefix = shared if index % 3 == 0 else []
        prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randrange(3, 30))]
        if index % 2:
            params = SamplingParams(
                temperature=0.9,
                top_k=rng.choice([0, 20]),
                top_p=rng.choice([1.0, 0.8]),
                min_p=0.05,
                seed=index,
                max_tokens=rng.randrange(*max_new),
                ignore_eos=True,
            )
        else:
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(*max_new), ignore_eos=True, stop_token_ids=(index % vocab,)
            )
        if index % 5 == 4:
            extras = {"presence_penalty": 0.8, "repetition_penalty": 1.3, "logit_bias": {index % vocab: 2.0}}
            params = msgspec.structs.replace(params, logprobs=2, **extras)
        requests.append((f"r{index}", prompt, params))
    requests.append(
        (ABORTED, [rng.randrange(vocab) for _ in range(10)], SamplingParams(temperature=0.0, max_tokens=30))
    )
    return requests


def run_mixed(engine: LLMEngine, requests, *, abort_after_steps: int = 4) -> dict[str, tuple[list[int], str]]:
    """Each request's tokens and finish reason; ABORTED is aborted after a few steps."""
    for request_id, prompt, params in requests:
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=params))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished():
        deltas = engine.step()
        steps += 1
        if steps == abort_after_steps:
            aborted = engine.abort_request(ABORTED)
            deltas = deltas + ([aborted] if aborted is not None else [])
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason
    return {request_id: (tokens.get(request_id, []), reasons.get(request_id)) for request_id, _, _ in requests}
