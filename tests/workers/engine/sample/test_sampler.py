from collections import Counter

import msgspec
import numpy as np
import pytest
import torch

from workers.engine.sample.sampler import Sampler, SamplerOutput, SamplingBatch
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]

VOCAB = 1000


def _batch(
    params: list[SamplingParams], prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None
) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch(
        params=params, prompt_token_ids=prompts or [[]] * rows, output_token_ids=outputs or [[]] * rows
    )


def _random_logits(rows: int, *, seed: int, vocab: int = VOCAB, device: str = "cpu") -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).mul_(3).to(device)


def _mixed_rows(rows: int, *, seed: int) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    """Rows that exercise every path: greedy, unseeded, seeded, bias, penalties, masks, logprobs."""
    rng = np.random.default_rng(seed)
    palette = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=20, logprobs=0),
        SamplingParams(temperature=1.2, top_p=0.8, seed=99, logit_bias={5: 10.0, 6: -100.0}),
        SamplingParams(min_p=0.2, frequency_penalty=1.0, presence_penalty=-0.5, logprobs=20),
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1, seed=7, repetition_penalty=0.8),
    ]
    params = [palette[int(i)] for i in rng.integers(0, len(palette), size=rows)]
    prompts = [rng.integers(0, VOCAB, size=rng.integers(0, 40)).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, VOCAB, size=rng.integers(0, 10)).tolist() for _ in range(rows)]
    return params, prompts, outputs


TARGETS = {
    "seeded": SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        min_p=0.01,
        seed=1234,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        logit_bias={3: 2.0},
        logprobs=5,
    ),
    "greedy": SamplingParams(temperature=0, presence_penalty=0.5, logprobs=20),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
@pytest.mark.parametrize(("size", "position"), [(2, 1), (32, 0), (32, 13), (32, 31)])
def test_a_row_gets_the_same_token_and_bitwise_logprobs_whatever_it_is_batched_with(
    device: str, target: SamplingParams, size: int, position: int
) -> None:
    prompt, output = [3, 17, 17, 256], [17, 900, 3]
    row_logits = _random_logits(1, seed=0, device=device)
    params, prompts, outputs = _mixed_rows(size, seed=size + position)
    params[position], prompts[position], outputs[position] = target, prompt, output
    logits = _random_logits(size, seed=1, device=device)
    logits[position] = row_logits[0]

    alone = Sampler(seed=5)(row_logits, _batch([target], [prompt], [output]))
    batched = Sampler(seed=6)(logits, _batch(params, prompts, outputs))

    assert batched.token_ids[position] == alone.token_ids[0]
    assert batched.logprobs[position] == alone.logprobs[0]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_generation_repeats_across_calls_positions_and_batch_sizes(device: str) -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    steps = [_random_logits(1, seed=step, device=device) for step in range(8)]

    def generate(batch_size: int, position: int, sampler_seed: int) -> list[int]:
        sampler, output = Sampler(seed=sampler_seed), []
        for step, row_logits in enumerate(steps):
            rows, prompts, outputs = _mixed_rows(batch_size, seed=step)
            rows[position], prompts[position], outputs[position] = params, [1, 2], list(output)
            logits = _random_logits(batch_size, seed=100 + step, device=device)
            logits[position] = row_logits[0]
            output.append(sampler(logits, _batch(rows, prompts, outputs)).token_ids[position])
        return output

    reference = generate(1, 0, sampler_seed=0)

    assert generate(1, 0, sampler_seed=0) == reference
    assert generate(32, 20, sampler_seed=1) == reference
    assert generate(7, 3, sampler_seed=2) == reference


def test_different_seeds_give_different_tokens() -> None:
    uniform = torch.zeros(100, VOCAB)
    seeds = [SamplingParams(seed=seed) for seed in range(100)]

    tokens = Sampler()(uniform, _batch(seeds)).token_ids

    # Adjacent seeds must not give correlated draws: 100 draws from 1000 tokens almost never collide much.
    assert len(set(tokens)) >= 90


def test_the_step_index_changes_the_draw_and_only_it_matters() -> None:
    uniform = torch.zeros(3, VOCAB)
    params = [SamplingParams(seed=8)] * 3

    tokens = Sampler()(uniform, _batch(params, outputs=[[], [5], [9]])).token_ids

    assert tokens[1] == tokens[2]
    assert tokens[0] != tokens[1]


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    uniform = torch.zeros(16, VOCAB)
    batch = _batch([SamplingParams()] * 16)

    first = Sampler(seed=1)(uniform, batch).token_ids

    assert Sampler(seed=1)(uniform, batch).token_ids == first
    assert Sampler(seed=2)(uniform, batch).token_ids != first
    assert len(set(first)) > 1


def _processed_logits(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """Bias and penalties as the spec states them, in float64 with loops."""
    x = np.array(logits, dtype=np.float64)
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def _processed_distribution(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """What the sampler must draw from: the processed logits through temperature and the masks."""
    x = _processed_logits(logits, params, prompt, output)
    probs = np.exp((x - x.max()) / params.temperature)
    probs /= probs.sum()
    if params.top_k > 0:
        probs[probs < np.sort(probs)[::-1][params.top_k - 1]] = 0
    ordered = np.sort(probs)[::-1]
    mass_before = np.concatenate([[0.0], np.cumsum(ordered)[:-1]])
    kept = int(np.sum(mass_before < params.top_p * probs.sum()))
    probs[probs < ordered[kept - 1]] = 0
    probs[probs < params.min_p * probs.max()] = 0
    return probs / probs.sum()


@pytest.mark.parametrize("seeding", ["sampler", "per_row"])
def test_sampled_frequencies_follow_the_processed_distribution(seeding: str) -> None:
    draws = 20_000
    logits = [1.0, 2.0, 0.5, 1.5, -1.0, 1.2, 0.1]
    prompt, output = [0, 2], [1, 1, 3]
    params = SamplingParams(
        temperature=0.8,
        top_k=6,
        top_p=0.9,
        min_p=0.5,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={4: 1.0},
    )
    expected = _processed_distribution(logits, params, prompt, output)
    assert set(np.nonzero(expected)[0]) == {0, 1, 3, 5}  # top-k, top-p and min-p each dropped a token
    if seeding == "sampler":
        rows = [params] * draws
    else:
        rows = [msgspec.structs.replace(params, seed=seed) for seed in range(draws)]

    tokens = Sampler(seed=3)(torch.tensor([logits] * draws), _batch(rows, [prompt] * draws, [output] * draws))

    counts = Counter(tokens.token_ids)
    frequencies = np.array([counts[token] / draws for token in range(len(logits))])
    np.testing.assert_allclose(frequencies, expected, atol=0.015)
    assert all(counts[token] == 0 for token in np.flatnonzero(expected == 0))


def test_greedy_rows_take_the_argmax() -> None:
    logits = _random_logits(8, seed=3)

    result = Sampler()(logits, _batch([SamplingParams(temperature=0)] * 8))

    assert result == SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * 8)


def test_greedy_takes_the_argmax_after_bias_and_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0, logit_bias={4: 3.05}),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.05),
    ]
    prompts, outputs = [[], [0], []], [[], [1], [0, 1]]

    tokens = Sampler()(logits, _batch(params, prompts, outputs)).token_ids

    assert tokens == [4, 2, 2]
    assert tokens == [
        int(np.argmax(_processed_logits(logits[row].tolist(), params[row], prompts[row], outputs[row])))
        for row in range(3)
    ]


def test_logprobs_come_from_the_raw_logits_with_rank_and_top() -> None:
    logits = _random_logits(3, seed=4, vocab=50)
    logits[2, 10:14] = logits[2].max() + 1  # four tokens tied for the top
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=4),
        SamplingParams(logprobs=0, seed=3),
        SamplingParams(temperature=0, logprobs=3),
    ]

    result = Sampler()(logits, _batch(params))

    assert result.token_ids[0] == 7  # chosen through the bias, reported without it
    assert result.token_ids[2] == 10  # argmax of a tie is the first
    for row, k in enumerate([4, 0, 3]):
        reference = torch.log_softmax(logits[row], dim=-1)
        token = result.token_ids[row]
        order = sorted(range(50), key=lambda t: (-float(reference[t]), t))
        assert result.logprobs[row] == TokenLogprobs(
            token_id=token,
            logprob=float(reference[token]),
            rank=1 + int((reference > reference[token]).sum()),
            top=[(t, float(reference[t])) for t in order[:k]],
        )
    tied = result.logprobs[2].logprob
    assert result.logprobs[2].top == [(10, tied), (11, tied), (12, tied)]


def test_the_logits_are_not_changed() -> None:
    logits = _random_logits(4, seed=5)
    before = logits.clone()
    params, prompts, outputs = _mixed_rows(4, seed=0)

    Sampler()(logits, _batch(params, prompts, outputs))

    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("logits", "batch", "message"),
    [
        (torch.zeros(2, 5).double(), _batch([SamplingParams()] * 2), "logits must be [batch, vocab] float32"),
        (torch.zeros(3, 5), _batch([SamplingParams()] * 2), "logits has 3 rows but the batch has 2"),
        (torch.zeros(1, 5), _batch([SamplingParams(logit_bias={5: 1.0})]), "logit_bias token id 5 >= vocab size 5"),
        (torch.zeros(1, 5), _batch([SamplingParams(repetition_penalty=2.0)], [[1, 5]]), "token ids must be in [0, 5)"),
    ],
)
def test_bad_inputs_are_refused(logits: torch.Tensor, batch: SamplingBatch, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        Sampler()(logits, batch)

    assert message in str(raised.value)


def test_batch_rows_must_line_up() -> None:
    with pytest.raises(ValueError, match="one row each"):
        SamplingBatch(params=[SamplingParams()], prompt_token_ids=[[1]], output_token_ids=[])
