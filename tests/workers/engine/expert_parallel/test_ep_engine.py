"""An EP engine of 2 and 4 gloo ranks (processes) serves a tiny random Qwen3-MoE with the greedy
tokens and logprobs of one process, with redundant experts too; a rank without requests does not
stall the others. A placement put in force while streams run changes none of their tokens and the
load counters follow the experts to their new slots; an invalid one changes nothing. When one of 4
ranks is killed, the group re-forms with 3, every expert is still served, the running greedy
streams complete with the same tokens, and a constrained stream goes on with its constraint where it
was."""

import os
import signal

import pytest
import torch

from tests.workers.engine.expert_parallel.tiny_moe import QWEN3_MOE
from workers.engine import LLM, SamplingParams
from workers.engine.expert_parallel import ep_engine
from workers.engine.expert_parallel.ep_engine import EPEngine
from workers.engine.parallel.placement import PlacementError
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import OutputConstraintSpec

# No prefix cache: the same prompts run twice route the same tokens (the load counter test).
SETTINGS = dict(seed=0, kv_cache_bytes=1 << 22, max_num_batched_tokens=32, enable_prefix_caching=False)
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80)), [7] * 9, [100, 1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


class Script:
    """A constraint that allows exactly one token per step: the script's, in order."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script, self.vocab_size, self.consumed = script, vocab_size, []

    def allowed_tokens(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.script[len(self.consumed)]] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.consumed.append(token_id)

    def is_finished(self) -> bool:
        return len(self.consumed) >= len(self.script)


def _tokens_and_logprobs(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    results = llm.generate(prompts, GREEDY)
    return [r.token_ids for r in results], [[entry.logprob for entry in r.logprobs] for r in results]


@pytest.fixture(scope="module")
def one_process():
    llm = LLM(QWEN3_MOE, **SETTINGS)
    yield _tokens_and_logprobs(llm, PROMPTS)
    llm.close()


@pytest.fixture(scope="module")
def ep2():
    llm = LLM(QWEN3_MOE, **SETTINGS, ep_size=2, ep_slots_per_rank=5)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ep4():
    llm = LLM(QWEN3_MOE, **SETTINGS, ep_size=4, ep_slots_per_rank=3)
    yield llm
    llm.close()


@pytest.mark.parametrize(("ep_size", "slots_per_rank"), [(2, 5), (4, 3)])
def test_ep_engine_matches_one_process(request, one_process, ep_size, slots_per_rank):
    llm = request.getfixturevalue(f"ep{ep_size}")
    engine = llm.engine
    assert isinstance(engine, EPEngine) and engine.ep_size == ep_size
    # Redundant slots hold replicas: some expert has two.
    layer = [expert for rank in engine.placement[0] for expert in rank]
    assert len(layer) == ep_size * slots_per_rank and len(set(layer)) == 8
    tokens, logprobs = _tokens_and_logprobs(llm, PROMPTS)
    assert tokens == one_process[0]
    for ours, theirs in zip(logprobs, one_process[1], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
    # One request: the other ranks have none and run empty passes; it completes all the same.
    tokens, _ = _tokens_and_logprobs(llm, PROMPTS[1:2])
    assert tokens == one_process[0][1:2]


def _streams(engine: EPEngine, prompts: list[list[int]], *, after_steps: int = -1, placement=None) -> list[list[int]]:
    """Run `prompts` to the end, putting `placement` in force after `after_steps` steps."""
    tokens = {f"s{i}": [] for i in range(len(prompts))}
    for request_id, prompt in zip(tokens, prompts, strict=True):
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY))
    steps = 0
    while engine.has_unfinished():
        if steps == after_steps:
            engine.apply_layout(8, placement)
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        steps += 1
    return list(tokens.values())


# Every expert once more than in the round-robin start: expert 7 on two slots, on both ranks.
MOVED = [[[7, 6, 5, 4, 3], [2, 1, 0, 7, 6]], [[7, 6, 5, 4, 3], [2, 1, 0, 7, 6]]]


def _per_expert(window: list[list[int]], placement: list[list[list[int]]]) -> list[list[int]]:
    totals = [[0] * 8 for _ in window]
    for layer, counts in enumerate(window):
        slots = [expert for rank in placement[layer] for expert in rank]
        for slot, count in enumerate(counts):
            totals[layer][slots[slot]] += count
    return totals


def test_a_placement_applied_while_streams_run_changes_no_token(ep2, one_process, monkeypatch):
    # Counters read at every step, so that a window holds exactly the steps run between two takes.
    monkeypatch.setattr(ep_engine, "LOAD_INTERVAL_S", 0.0)
    engine = ep2.engine
    start = engine.placement
    engine.step()  # nothing to run: only reads what earlier tests left in the counters
    engine.take_expert_load()
    assert _streams(engine, PROMPTS) == one_process[0]
    before = engine.take_expert_load()

    assert _streams(engine, PROMPTS, after_steps=3, placement=MOVED) == one_process[0]
    assert engine.placement == MOVED
    # The same traffic again, all of it under the new placement: every expert gets the tokens it
    # got before, now counted at its new slots, and expert 7's load is spread over its two.
    engine.take_expert_load()
    assert _streams(engine, PROMPTS) == one_process[0]
    after = engine.take_expert_load()
    assert _per_expert(after, MOVED) == _per_expert(before, start)
    slots_of_7 = [0, 8]
    for layer in after:
        assert sum(layer) > 0 and all(layer[slot] > 0 for slot in slots_of_7)


@pytest.mark.parametrize(
    ("experts", "placement", "message"),
    [
        (8, [[[0, 1, 2, 3, 4], [5, 6, 0, 1, 2]]] * 2, r"experts \[7\] have no slot"),
        (8, [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2, "every rank has 5 expert slots"),
        (8, [[[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]], "2 layers"),
        (8, [[[0, 1, 2, 3, 4]], [[5, 6, 7, 0, 1]]], "must have 2 ranks"),
        (4, [[[0, 1, 2, 3, 0], [1, 2, 3, 0, 1]]] * 2, "8 experts"),
    ],
    ids=["expert-missing", "slot-count", "layer-count", "rank-count", "expert-count"],
)
def test_an_invalid_placement_is_refused_and_the_one_in_force_stays(ep2, one_process, experts, placement, message):
    engine = ep2.engine
    in_force = engine.placement
    with pytest.raises(PlacementError, match=message):
        engine.apply_layout(experts, placement)
    assert engine.placement == in_force
    tokens, _ = _tokens_and_logprobs(ep2, PROMPTS[:1])
    assert tokens == one_process[0][:1] and engine.placement == in_force


def test_a_killed_rank_leaves_three_that_finish_every_stream(ep4, one_process, monkeypatch):
    """Last of the ep4 tests: it kills one of the engine's ranks."""
    engine = ep4.engine
    victim = engine.remotes[1].process
    tokens = {f"k{i}": [] for i in range(len(PROMPTS))}
    for request_id, prompt in zip(tokens, PROMPTS, strict=True):
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY))
    # A constrained stream (rank 0's): resubmitted after the re-form, its constraint goes on where it
    # was, so the stream is the script and nothing of it twice.
    script = [5, 9, 2, 77, 31, 64, 8, 120, 3, 41, 17, 99]
    monkeypatch.setattr(engine, "_compile", lambda request_id, spec: Script(script, QWEN3_MOE["vocab_size"]))
    tokens["scripted"] = []
    engine.add_request(
        EngineRequest(
            request_id="scripted",
            prompt_token_ids=PROMPTS[0],
            params=GREEDY,
            constraint=OutputConstraintSpec(kind="regex", schema="hand-written"),
        )
    )
    steps = 0
    while engine.has_unfinished():
        if steps == 4:
            os.kill(victim.pid, signal.SIGKILL)
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        steps += 1
    assert [tokens.pop("scripted")] == [script]
    assert list(tokens.values()) == one_process[0]
    assert engine.ep_size == 3 and not victim.is_alive()
    assert "re-formed with 3 ranks" in engine.resize_reason and engine.resized_at > 0
    for layer in engine.placement:
        assert len(layer) == 3 and {expert for rank in layer for expert in rank} == set(range(8))
    # The re-formed group serves new requests too.
    assert _tokens_and_logprobs(ep4, PROMPTS[:2])[0] == one_process[0][:2]
