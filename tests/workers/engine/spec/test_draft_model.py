"""The draft-model drafter: a model sharing the target's tokenizer, run by an engine of its own, drafts
its greedy continuation (the target's own, when it is the same model), reuses a request's history
between proposals through its prefix cache, and a model of another tokenizer or vocabulary is refused
naming spec_draft_model."""

import json
import math
from pathlib import Path

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.args import EngineArgs
from workers.engine import LLM, SamplingParams
from workers.engine.builder import build_draft_drafter
from workers.engine.spec.draft_model import DraftModelDrafter
from workers.engine.spec.drafter import DraftAsk
from workers.engine.weights.loader import resolve_model
from workers.protocol.errors import ModelLoadError

SMOLLM2 = "smollm2-135m-instruct"
# A tiny model with SmolLM2's vocabulary, drafting for the same or another tiny model.
CONFIG = dict(TINY_CONFIGS["llama"], vocab_size=49152)
SETTINGS = dict(seed=0, kv_cache_bytes=1 << 24, tokenizer=SMOLLM2, max_model_len=256)


@pytest.fixture(scope="module")
def target() -> LLM:
    return LLM(CONFIG, **SETTINGS)


def drafter_for(target: LLM, draft_model) -> DraftModelDrafter:
    info = target.engine.info
    return build_draft_drafter(
        draft_model,
        EngineArgs(model=CONFIG, **SETTINGS),
        tokenizer=info.tokenizer,
        vocab_size=info.model_config.vocab_size,
        max_model_len=info.max_model_len,
    )


def test_the_target_s_own_model_drafts_its_greedy_continuation_and_reuses_the_history(target):
    drafter = drafter_for(target, CONFIG)
    prompt = target.tokenizer.encode("Once upon a time, in a land far away, there lived a")
    [expected] = target.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    continuation = expected.outputs[0].token_ids

    first = drafter.propose_all([DraftAsk("r", prompt, [], 5)])[0]
    computed = drafter.engine.runner.num_computed_tokens
    second = drafter.propose_all([DraftAsk("r", prompt, continuation[:5], 6)])[0]

    assert first.token_ids == continuation[:5] and second.token_ids == continuation[5:11]
    assert len(first.probs) == 5 and all(0 < p <= 1 for p in first.probs + second.probs)
    # The second proposal computed the tokens since the first one's last full page, not the history.
    assert drafter.engine.runner.num_computed_tokens - computed < len(prompt)
    assert drafter.propose_all([DraftAsk("r", prompt, [], 0)])[0].token_ids == []


def test_another_model_drafts_what_it_would_generate(target):
    other = dict(CONFIG, num_hidden_layers=1)
    drafter = drafter_for(target, other)
    prompt = target.tokenizer.encode("The quick brown fox")
    [alone] = LLM(other, **SETTINGS).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    draft = drafter.propose_all([DraftAsk("r", prompt, [], 4)])[0]

    assert draft.token_ids == alone.outputs[0].token_ids
    assert all(0 < p <= 1 for p in draft.probs) and not all(math.isclose(p, 1.0) for p in draft.probs)


def test_a_draft_model_of_another_vocabulary_size_is_refused(target):
    with pytest.raises(ModelLoadError, match="spec_draft_model .* reads 128 token ids, the target 49152"):
        drafter_for(target, dict(CONFIG, vocab_size=128))


def test_a_draft_model_with_another_tokenizer_is_refused(target, tmp_path: Path):
    # A model directory of its own (random weights) whose tokenizer swaps two tokens' ids.
    files = resolve_model(SMOLLM2)
    tokenizer = json.loads(files.tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = "hello", "world"
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(files.tokenizer_config))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))

    with pytest.raises(ModelLoadError, match="spec_draft_model .* has another tokenizer than the target"):
        drafter_for(target, tmp_path)


def test_no_draft_model_is_refused_naming_the_setting(target):
    with pytest.raises(ModelLoadError, match="spec_method 'draft' needs spec_draft_model"):
        drafter_for(target, None)


def test_a_step_s_asks_are_drafted_as_one_batch_each_as_it_would_be_alone(target):
    drafter = drafter_for(target, CONFIG)
    prompts = [target.tokenizer.encode(text) for text in ("One fish, two fish", "Red fish, blue fish, old fish")]
    asks = [DraftAsk("a", prompts[0], [], 4), DraftAsk("b", prompts[1], [], 0), DraftAsk("c", prompts[1], [], 3)]
    alone = [drafter.propose_all([ask])[0] for ask in asks]
    steps = drafter.engine.stats().steps.num_steps

    together = drafter.propose_all(asks)

    assert together == alone and together[1].token_ids == [] and len(together[2]) == 3
    assert drafter.engine.stats().steps.num_steps - steps <= 5  # one step per drafted position, not per ask
