"""Output constraints (token masks), prompt logprobs and the waiting-queue cap, on a tiny model."""

import random

import pytest
import torch

from kernels.attention import AttentionMetadata, default_backend, get_backend
from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.engine.requests import add_constrained
from workers.args import EngineArgs
from workers.engine import LLM, EngineOverloadedError, InvalidRequestError, RequestDelta, SamplingParams
from workers.engine.builder import engine_config
from workers.engine.engine import LLMEngine
from workers.engine.kv.kv_cache import KVCache
from workers.engine.model_loader import load_model
from workers.protocol.engine_request import EngineRequest

CONFIG = TINY_CONFIGS["qwen3_qknorm_layer_types"]
VOCAB = CONFIG["vocab_size"]
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)


class FixedSetConstraint:
    """Allows only `allowed`; the output is complete after `length` tokens."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.mask = torch.zeros(VOCAB, dtype=torch.bool)
        self.mask[sorted(allowed)] = True
        self.length = length
        self.consumed: list[int] = []

    def allowed_tokens(self) -> torch.Tensor:
        return self.mask

    def advance(self, token_id: int) -> None:
        assert self.mask[token_id], f"sampled token {token_id} was not allowed"
        self.consumed.append(token_id)

    def is_finished(self) -> bool:
        return len(self.consumed) >= self.length


class ScriptConstraint(FixedSetConstraint):
    """Allows exactly one token per step: the script, in order."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(set(), len(script))
        self.script = script

    def allowed_tokens(self) -> torch.Tensor:
        self.mask = torch.zeros(VOCAB, dtype=torch.bool)
        self.mask[self.script[len(self.consumed)]] = True
        return self.mask


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


@pytest.fixture
def engine() -> LLMEngine:
    return LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=64).engine


def test_constraint_is_obeyed_in_a_mixed_batch_and_every_row_matches_its_solo_run(engine):
    allowed = {5, 17, 42, 99}
    rows = {
        "constrained-greedy": (random_prompt(30, 1), GREEDY, True),
        "constrained-sampled": (random_prompt(12, 2), SAMPLED, True),
        "free-greedy": (random_prompt(50, 3), GREEDY, False),
        "free-sampled": (random_prompt(7, 4), SAMPLED, False),
    }

    def submit(suffix: str, names: list[str]) -> dict[str, FixedSetConstraint]:
        constraints = {}
        for name in names:
            prompt, params, constrained = rows[name]
            constraint = FixedSetConstraint(allowed, length=3) if constrained else None
            add_constrained(
                engine, EngineRequest(request_id=name + suffix, prompt_token_ids=prompt, params=params), constraint
            )
            constraints[name] = constraint
        return constraints

    constraints = submit("", list(rows))
    batched = run_to_completion(engine)
    solo = {}
    for name in rows:
        submit("-solo", [name])
        solo[name] = tokens_of(run_to_completion(engine)[name + "-solo"])

    for name, (_, _, constrained) in rows.items():
        tokens = tokens_of(batched[name])
        assert tokens == solo[name]
        if constrained:
            assert len(tokens) == 3 and set(tokens) <= allowed
            assert constraints[name].consumed == tokens
            assert batched[name][-1].finish_reason == "stop"
        else:
            assert len(tokens) == 10 and batched[name][-1].finish_reason == "length"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_mask_that_changes_every_step_is_followed_token_by_token(engine, params):
    script = [7, 3, 99, 3]
    add_constrained(
        engine,
        EngineRequest(request_id="scripted", prompt_token_ids=random_prompt(20, 5), params=params),
        ScriptConstraint(script),
    )
    deltas = run_to_completion(engine)["scripted"]
    assert tokens_of(deltas) == script
    assert deltas[-1].finish_reason == "stop"


def test_constrained_logprobs_describe_the_raw_model(engine):
    prompt = random_prompt(25, 6)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    engine.add_request(EngineRequest(request_id="free", prompt_token_ids=prompt, params=params))
    free = run_to_completion(engine)["free"][0].logprobs[0]
    add_constrained(
        engine,
        EngineRequest(request_id="masked", prompt_token_ids=prompt, params=params),
        FixedSetConstraint({free.top[3][0]}, length=1),
    )
    masked = run_to_completion(engine)["masked"][0].logprobs[0]
    # The second run reuses the first's cached prefix, so its logits agree only as far as the CPU's
    # BLAS is batch-invariant (bitwise here, not on every CPU); a masked distribution would be far off.
    assert masked.token_id == free.top[3][0] and masked.rank == 4
    assert masked.logprob == pytest.approx(free.top[3][1], abs=1e-5)
    assert [token for token, _ in masked.top] == [token for token, _ in free.top]
    assert [logprob for _, logprob in masked.top] == pytest.approx([logprob for _, logprob in free.top], abs=1e-5)


def reference_logprobs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of one full-prompt forward of the engine's model, [len(prompt), V]."""
    kv = KVCache.for_model(engine.model_config, num_pages=5, page_size=16, dtype=torch.float32, device=CPU)
    metadata = AttentionMetadata.build(
        query_lens=[len(prompt)], seq_lens=[len(prompt)], block_tables=[[1, 2, 3, 4]], page_size=16, device=CPU
    )
    model, attend = engine.runner.model, get_backend(default_backend(CPU))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), kv.layers, [metadata] * len(kv.layers), attend)
        return model.compute_logits(hidden).log_softmax(dim=-1)


def test_prompt_logprobs_match_a_full_prompt_forward_across_chunks_without_a_prefix_hit():
    engine = LLM(CONFIG, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16).engine
    prompt = random_prompt(45, 8)  # three prefill chunks of at most 16 tokens
    engine.add_request(EngineRequest(request_id="warm", prompt_token_ids=prompt, params=GREEDY))
    run_to_completion(engine)
    before = engine.stats().num_computed_tokens

    engine.add_request(
        EngineRequest(
            request_id="echo",
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0.0, max_tokens=3),
            prompt_logprobs=4,
        )
    )
    deltas = run_to_completion(engine)["echo"]

    first = deltas[0]
    assert first.num_cached_tokens == 0
    assert engine.stats().num_computed_tokens - before == len(prompt) + 2
    assert [d.prompt_logprobs for d in deltas[1:]] == [None, None]
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    expected = reference_logprobs(engine, prompt)
    for position, entry in enumerate(entries[1:], start=1):
        row = expected[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-5)
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        assert [token for token, _ in entry.top] == row.topk(4).indices.tolist()


def test_a_request_without_prompt_logprobs_still_hits_the_pages_an_echo_request_cached(engine):
    prompt = random_prompt(40, 9)
    engine.add_request(EngineRequest(request_id="echo", prompt_token_ids=prompt, params=GREEDY, prompt_logprobs=0))
    echo = run_to_completion(engine)["echo"]
    assert all(entry.top == [] for entry in echo[0].prompt_logprobs[1:])
    engine.add_request(EngineRequest(request_id="plain", prompt_token_ids=prompt, params=GREEDY))
    plain = run_to_completion(engine)["plain"]
    assert plain[0].num_cached_tokens == 32
    assert tokens_of(plain) == tokens_of(echo)


@pytest.mark.parametrize("count", [-1, 21, 2.5])
def test_out_of_range_prompt_logprobs_are_refused(engine, count):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        engine.add_request(
            EngineRequest(request_id="bad", prompt_token_ids=[1, 2, 3], params=GREEDY, prompt_logprobs=count)
        )
    assert not engine.has_unfinished()


def test_max_waiting_refuses_requests_past_the_cap_until_the_queue_drains():
    loaded = load_model(CONFIG, device=CPU, dtype=None, seed=0, max_model_len=None)
    engine = LLMEngine(
        loaded, engine_config(EngineArgs(model=CONFIG, kv_cache_bytes=1 << 24, max_num_seqs=1, max_waiting=2))
    )
    engine.add_request(EngineRequest(request_id="a", prompt_token_ids=[1, 2, 3], params=GREEDY))
    engine.add_request(EngineRequest(request_id="b", prompt_token_ids=[1, 2, 3], params=GREEDY))
    with pytest.raises(EngineOverloadedError):
        engine.add_request(EngineRequest(request_id="c", prompt_token_ids=[1, 2, 3], params=GREEDY))
    engine.step()  # admits "a"; "b" still waits
    engine.add_request(EngineRequest(request_id="c", prompt_token_ids=[1, 2, 3], params=GREEDY))
    with pytest.raises(EngineOverloadedError):
        engine.add_request(EngineRequest(request_id="d", prompt_token_ids=[1, 2, 3], params=GREEDY))
    assert sorted(run_to_completion(engine)) == ["a", "b", "c"]
