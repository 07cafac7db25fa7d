"""Verification of drafted tokens: the target samples every position of a sequence's draft, and the
draft is kept up to its first token the target did not sample.

A sequence that verifies d drafts has d + 1 rows of logits: row j scores the token after its tokens
and drafts[:j]. Each row is sampled as the Sampler samples any row, with row j's history (what
penalties count, and the step index that keys a seeded request's noise) extended by drafts[:j]. The
emitted tokens are the samples up to and including the first that differs from its draft (or the
bonus sample after the last draft, when every draft matched).

This is exact rejection sampling (Leviathan et al.) for a point-mass draft x: the draft is accepted
exactly when the target's sample is x, with probability p(x), and when it is not, the sample is the
target's distribution with x removed and renormalised. So the output is distributed as without
speculation, and more: a sample at a given position is the draw that position gets without
speculation (the same noise, keyed by the request's seed and step index, from the same processed
logits, since the history before it is the same), so greedy and seeded requests emit exactly the
tokens they would one token per step, alone or in any batch.

On the device path a step whose samples need no history (runner.device_sampling's "greedy" and
"sample" modes) is verified on the device (accept_on_device): the samples are drawn there, and which
of them a sequence emits is found there too, so the host reads one array back; a step with penalties,
logit bias, logprobs or a constraint is verified by the host Sampler (sample_and_verify).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.runner.request_states import ScheduledSequence
from workers.engine.sample.sampler import Sampler, SamplingBatch
from workers.protocol.logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Verified:
    """What one sequence emits: its accepted drafts, then the target's own token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per token; None where the request asked for none
    num_accepted: int


def accept_on_device(
    tokens: torch.Tensor, draft_ids: torch.Tensor, first_sample: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which samples each sequence emits, with no host sync: its samples up to and including the
    first that differs from its draft (a sequence's last sample has no draft, -1, and always
    differs). `tokens`, `draft_ids`, `first_sample`: [samples], each sequence's samples consecutive,
    `first_sample` the index of the sequence's first. Returns the tokens with -1 where not emitted,
    and the mask of each sequence's last emitted sample."""
    differs = (tokens != draft_ids).to(torch.int32)
    # Samples that differ before each one: a sequence emits those with none before them in it.
    before = torch.cumsum(differs, 0) - differs
    emitted = before == before.index_select(0, first_sample)
    ends = emitted & differs.bool()
    return torch.where(emitted, tokens, -1), ends


def num_rows(sequence: ScheduledSequence) -> int:
    """Rows of logits a sampling sequence needs: one per draft, plus the one after them."""
    return len(sequence.draft_token_ids) + 1


def sample_and_verify(sampler: Sampler, logits: torch.Tensor, sequences: Sequence[ScheduledSequence]) -> list[Verified]:
    """`logits`: the rows of every sequence (num_rows each), in order."""
    params, prompts, outputs, allowed = [], [], [], []
    for sequence in sequences:
        state = sequence.state
        drafts = sequence.draft_token_ids
        # A constrained request's rows are masked as its constraint would be after the drafts before
        # each (the speculator cut its drafts to what the constraint allows).
        if state.constraint is None:
            masks = [None] * (len(drafts) + 1)
        else:
            masks = state.constraint.masks_along(drafts) if drafts else [state.constraint.allowed_tokens()]
        for j in range(len(drafts) + 1):
            params.append(state.params)
            prompts.append(state.prompt_token_ids)
            outputs.append(state.output_token_ids + drafts[:j] if j else state.output_token_ids)
            allowed.append(masks[j])
    result = sampler(logits, SamplingBatch(params, prompts, outputs, allowed))
    verified = []
    row = 0
    for sequence in sequences:
        drafts = sequence.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and result.token_ids[row + accepted] == drafts[accepted]:
            accepted += 1
        emitted = slice(row, row + accepted + 1)
        verified.append(Verified(result.token_ids[emitted], result.logprobs[emitted], accepted))
        row += len(drafts) + 1
    return verified
