"""Turns a scheduled step into tensors, runs the model over the paged KV cache, samples.

Two paths, chosen by the attention backend:
- The reference path (torch backends; the CPU default) builds the step's tensors from lists and
  pads every matmul's row count to at least `min_invariant_rows()` on the CPU, past the size at
  which the BLAS switches kernels for small matrices; with the blockwise backend this makes results
  batch-invariant. Logits are computed for the rows that sample: a request that verifies drafts
  samples at each of them and after the last, and keeps the drafts its samples agree with
  (runner.verify).
- The device path (the Triton backend; the CUDA default) keeps a persistent input batch (block
  tables on the device, one host-to-device copy of a packed step buffer per step), runs the fused
  Triton layer ops, samples on the device, and replays the whole decode step from CUDA graphs per
  batch bucket. The host reads back one thing per step: the sampled ids. Rows that need logit bias,
  penalties, logprobs or an output constraint are sampled from the same logits by the host-driven
  Sampler instead.
  A step that verifies drafts samples each of its drafts' positions and picks what each sequence
  emits on the device too (runner.verify.accept_on_device), and replays a verify graph bucketed by
  its total tokens when every sequence in it is a decode; one whose rows need the host Sampler (bias,
  penalties, logprobs, a constraint) runs eagerly and is verified there, as on the reference path.

With MTP drafting (--spec-method mtp, runner.mtp_pass) both paths run the model's MTP layer after
each step over the step's final hidden states and the tokens it emitted, and return its drafts in
StepOutput.drafts: the reference path within the step, the device path when the step's result
reaches the host (LaunchedStep.result; such a step is never deferred). On the device path every
step then runs eagerly, none from a CUDA graph: a graph's hidden states stay inside it.

Both paths read the runner's own record of its requests (runner.request_states), kept from the
scheduler's output: each request in full once, then only the pages it gains. Prompt logprobs (both
paths) are computed eagerly for every prompt position of the requests that ask for them. This is
the only engine component that builds tensors.

A vision-language prompt's image embeddings replace the embeddings of the placeholders a step
computes, on both paths, found by position: a chunk that cuts an image, or that starts inside one
after a prefix hit, takes the rows it holds. A step with any such rows runs eagerly, never from a
CUDA graph (graphs replay decode steps, which hold no prompt tokens, but a prompt's last token can
run alone in a decode-shaped step). While no request the runner holds has images, a step does no
work for them.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from kernels.attention import AttentionMetadata, StepBatch, default_backend, get_backend, layer_metadata
from kernels.batch_invariance import min_invariant_rows
from workers.engine.config import EngineConfig
from workers.engine.kv.kv_cache import KVCache
from workers.engine.models.decoder import DecoderForCausalLM, InjectedEmbeddings
from workers.engine.runner import device_sampling
from workers.engine.runner.cuda_graphs import StepGraphs, decode_layouts, verify_layouts
from workers.engine.runner.device_sampling import SampledLogprobs, logprobs_entry
from workers.engine.runner.input_batch import InputBatch, StepInputs, StepPlan
from workers.engine.runner.mtp_pass import MtpPass
from workers.engine.runner.request_states import RequestState, RequestStates, ScheduledSequence
from workers.engine.runner.verify import Verified, accept_on_device, num_rows, sample_and_verify
from workers.engine.sample.sampler import Sampler, token_logprobs
from workers.engine.sched.output import SchedulerOutput
from workers.engine.spec.drafter import Draft
from workers.protocol.images import ImageEmbeddings
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import MAX_LOGPROBS

# The sampling modes whose steps verify drafts on the device: their samples need no history.
DEVICE_VERIFY_MODES = ("greedy", "sample")

# Prompt logprobs are computed this many positions at a time, which bounds the [rows, vocab] logits
# a long prompt chunk would otherwise materialise at once.
PROMPT_LOGITS_ROWS = 256


# Not frozen: one is built per sampled token, and a frozen dataclass constructs several times slower.
@dataclass(slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens first_index, first_index + 1, ... computed in one step."""

    request_id: str
    first_index: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class StepOutput:
    # In batch order; a request that verified drafts has one per token it emits, consecutive.
    sampled: list[SampledToken]
    prompt_logprobs: list[PromptLogprobs]
    # Of the requests that verified drafts, how many of its drafts each accepted.
    num_accepted: dict[str, int] = field(default_factory=dict)
    # With MTP drafting (runner.mtp_pass): the drafts after each sampling request's last token.
    drafts: dict[str, Draft] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        *,
        attention_backend: str,
        device: torch.device,
        seed: int,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        enforce_eager: bool = False,
        max_draft_tokens: int = 0,
        mtp_draft_tokens: int = 0,
    ) -> None:
        """`max_draft_tokens`: the most drafts a sequence verifies in a step (speculative decoding's
        K; 0 without it). `mtp_draft_tokens`: with a model that holds its MTP layers (models.mtp),
        drafts it makes after each step for speculative decoding (runner.mtp_pass); 0 for none."""
        self.model = model
        self.kv_cache = kv_cache
        self.backend = get_backend(attention_backend)
        config = model.config
        # An MLA layer attends its latent: keys as wide as the latent, values its compressed part.
        key_dim, value_dim = (
            (config.mla.latent_width, config.mla.kv_lora_rank) if config.mla else (config.head_dim, None)
        )
        self.backend.check_model(head_dim=key_dim, value_dim=value_dim, dtype=kv_cache.dtype, device=device)
        self.device = device
        self.min_rows = min_invariant_rows() if device.type == "cpu" else 1
        self.sampler = Sampler(seed=seed)
        self.num_computed_tokens = 0  # tokens run through the model since start: proves prefix hits skip work
        self.states = RequestStates()
        self.mtp_pass = None
        if model.mtp is not None and mtp_draft_tokens:
            self.mtp_pass = MtpPass(model.mtp, kv_cache, self.backend, max_draft_tokens=mtp_draft_tokens)
        self.max_draft_tokens = max_draft_tokens
        self.batch: InputBatch | None = None
        self.graphs: StepGraphs | None = None  # decode steps'
        self.verify_graphs: StepGraphs | None = None
        # Pinned buffers for the sampled ids (and logprobs) of the last two steps: async scheduling
        # reads one step late.
        self._pinned: list[_PinnedOutputs] = []
        self._pinned_turn = 0
        if self.backend.needs_device_tensors:
            model.use_fused_ops(True)
            self.batch = InputBatch(
                max_rows=max_num_seqs,
                max_pages=-(-max_model_len // kv_cache.page_size),
                page_size=kv_cache.page_size,
                vocab_size=config.vocab_size,
                device=device,
                seed=seed,
                num_groups=len(kv_cache.specs.groups),
            )
            if self.supports_cuda_graphs and not enforce_eager:
                self.capture_decode_graphs(modes=("greedy",))

    @classmethod
    def for_engine(
        cls,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        config: EngineConfig,
        *,
        max_model_len: int,
        enforce_eager: bool,
    ) -> "ModelRunner":
        """The runner of an engine with `config`: its own, or the one its memory profile measures."""
        device = torch.device(config.args.device)
        return cls(
            model,
            kv_cache,
            attention_backend=config.args.attention_backend or default_backend(device),
            device=device,
            seed=config.args.seed,
            max_num_seqs=config.args.max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            max_draft_tokens=config.args.spec_max_draft_tokens if config.args.spec_method != "none" else 0,
            mtp_draft_tokens=config.args.spec_max_draft_tokens if config.args.spec_method == "mtp" else 0,
        )

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether decode steps can replay CUDA graphs here: the device path on CUDA, without MTP
        drafting (its pass reads each step's hidden states, which a graph keeps to itself)."""
        return (
            self.batch is not None
            and self.device.type == "cuda"
            and self.backend.supports_cuda_graphs
            and self.mtp_pass is None
        )

    # In inference mode, as the captures on first use are (inside launch): the rows' sampling history
    # is made of inference tensors, and without autograd's records a captured step's activations are
    # not all held at once (the graphs' pool is sized by their peak, not their sum).
    @torch.inference_mode()
    def capture_decode_graphs(self, modes: Sequence[str]) -> None:
        """Capture the decode step of every batch bucket in these sampling modes (a step in another
        mode captures its own on first use), and with speculation the verify step of every token
        bucket in those of these modes that verify on the device."""
        pool = torch.cuda.graph_pool_handle()
        groups = self.batch.num_groups
        self.graphs = StepGraphs(
            self.batch,
            self._decode_forward,
            decode_layouts(self.batch.max_rows, groups),
            decode_only=True,
            max_query_len=1,
            device=self.device,
            pool=pool,
        )
        if self.max_draft_tokens:
            self.verify_graphs = StepGraphs(
                self.batch,
                self._verify_forward,
                verify_layouts(self.batch.max_rows, self.max_draft_tokens, groups),
                decode_only=False,
                max_query_len=self.max_draft_tokens + 1,
                device=self.device,
                pool=pool,
            )
            self.verify_graphs.capture(modes=[m for m in modes if m in DEVICE_VERIFY_MODES])
        self.graphs.capture(modes=modes)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput) -> "LaunchedStep":
        """Start the step. On the device path a step whose rows all sample on the device returns
        before the device is done (`deferred`); its result() waits for the sampled ids."""
        dropped = self.states.update(output)
        injected = self._injected(output) if self.states.num_with_images else None
        if self.batch is None:
            return LaunchedStep(self._execute_reference(self.states.scheduled(output), injected))
        self.batch.update(output, dropped)
        return self._launch_on_device(output, injected)

    def _injected(self, output: SchedulerOutput) -> InjectedEmbeddings | None:
        """The image embeddings of the placeholders the step's sequences compute, at their rows of
        the step's flattened tokens; None when the step computes none."""
        rows: list[np.ndarray] = []
        embeddings: list[torch.Tensor] = []
        first_row = 0
        for request_id, start, count in zip(
            output.request_ids, output.num_computed_tokens, output.num_scheduled_tokens, strict=True
        ):
            state = self.states[request_id]
            if state.images is not None:
                positions = state.images.positions
                lo, hi = np.searchsorted(positions, (start, start + count))
                if hi > lo:
                    rows.append(positions[lo:hi] - start + first_row)
                    embeddings.append(self._image_embeddings(state)[lo:hi])
            first_row += count
        if not rows:
            return None
        return InjectedEmbeddings(
            rows=torch.from_numpy(np.concatenate(rows)).to(self.device), embeddings=torch.cat(embeddings)
        )

    def _image_embeddings(self, state: RequestState) -> torch.Tensor:
        """A request's image embeddings, concatenated in the model's dtype on its device (built once)."""
        if state.image_embeddings is None:
            dtype = self.model.embed_tokens.weight.dtype
            parts = [embeddings_tensor(image) for image in state.images.embeddings]
            state.image_embeddings = torch.cat(parts).to(device=self.device, dtype=dtype)
        return state.image_embeddings

    def pinned_outputs(self) -> "_PinnedOutputs":
        """One of two sets of pinned buffers, in turn, for a step's sampled ids and logprobs."""
        if not self._pinned:
            samples = self.batch.max_rows * (self.max_draft_tokens + 1)
            self._pinned = [_PinnedOutputs(samples + 1) for _ in range(2)]
        self._pinned_turn ^= 1
        return self._pinned[self._pinned_turn]

    # The device path.

    def _launch_on_device(self, output: SchedulerOutput, injected: InjectedEmbeddings | None) -> "LaunchedStep":
        plan = self.batch.plan(output, self.states)
        self.num_computed_tokens += plan.num_tokens
        if len(plan.constrained):
            self._stage_constraint_masks(plan, output)
        verifies = bool(output.draft_token_ids)
        if verifies and plan.mode not in DEVICE_VERIFY_MODES:
            return LaunchedStep(self._verify_on_host(output, plan, injected))
        prompt_logprobs: list[PromptLogprobs] = []
        then: Callable[[StepOutput], StepOutput] | None = None
        # A graph replays its captured inputs only: a step that injects embeddings runs eagerly.
        graphs = self.verify_graphs if plan.verify_only else self.graphs if plan.decode_only else None
        if injected is None and graphs is not None and graphs.fits(plan.num_tokens):
            tokens, logprobs = graphs.run(plan, output, self.states)
        else:
            layout, device_buffer = self.batch.prepare(plan, output, self.states)
            inputs = self.batch.step_inputs(
                layout, device_buffer, decode_only=plan.decode_only, max_query_len=plan.max_query_len
            )
            hidden = self._hidden(inputs, injected)
            if plan.prompt_logprobs:
                query_starts = np.concatenate([[0], np.cumsum(plan.counts)])
                prompt_logprobs = [
                    self._prompt_logprobs(self._sequence(output, i), hidden, int(query_starts[i]))
                    for i in plan.prompt_logprobs
                ]
            if self.mtp_pass is not None:
                # The emitted tokens reach the host with the step's result: the pass drafts then.
                starts = np.concatenate([[0], np.cumsum(plan.counts)]).tolist()
                then = partial(self._with_drafts, self.states.scheduled(output), hidden, starts)
            if not len(plan.sampling):
                result = StepOutput(sampled=[], prompt_logprobs=prompt_logprobs)
                return LaunchedStep(result if then is None else then(result))
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))
            tokens, logprobs = self._sample(logits, inputs, plan.mode, verifies=verifies)
        sequences = [output.request_ids[i] for i in plan.sampling]
        request_ids = (
            [r for r, count in zip(sequences, plan.samples_per_sequence.tolist()) for _ in range(count)]
            if verifies
            else sequences
        )
        num_logprobs = [int(k) for k in self.batch.logprobs[plan.rows[plan.sampling]]] if logprobs else None
        pinned = self.pinned_outputs() if self.device.type == "cuda" else None
        drafting = [output.request_ids[i] for i in np.flatnonzero(plan.draft_counts)] if verifies else None
        deferred = DeferredTokens(tokens, logprobs, request_ids, num_logprobs, pinned, drafting=drafting)
        # A constrained request's next mask needs this token, the scheduler places a verifying
        # request's next step by what it accepted, and MTP drafts follow it: the next step waits.
        can_defer = not len(plan.constrained) and not verifies and then is None
        return LaunchedStep(None, deferred, prompt_logprobs=prompt_logprobs, can_defer=can_defer, then=then)

    def _verify_on_host(
        self, output: SchedulerOutput, plan: StepPlan, injected: InjectedEmbeddings | None
    ) -> StepOutput:
        """A step that verifies drafts of rows that need the host Sampler, eagerly: the forward on the
        device, then every sampling sequence sampled by the host Sampler at each of its drafts and
        after them (runner.verify), as the reference path does. Each row's last token and sampling
        history on the device then take in what it emitted, so the steps after it decode on the
        device as usual."""
        layout, device_buffer = self.batch.prepare(plan, output, self.states)
        inputs = self.batch.step_inputs(layout, device_buffer, decode_only=False, max_query_len=plan.max_query_len)
        hidden = self._hidden(inputs, injected)
        query_ends = np.cumsum(plan.counts)
        scheduled = self.states.scheduled(output)
        prompt_logprobs = [
            self._prompt_logprobs(scheduled[i], hidden, int(query_ends[i] - plan.counts[i]))
            for i in plan.prompt_logprobs
        ]
        sequences = [scheduled[i] for i in plan.sampling]
        rows = [
            row
            for i, s in zip(plan.sampling, sequences, strict=True)
            for row in range(int(query_ends[i]) - num_rows(s), int(query_ends[i]))
        ]
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))
        verified = sample_and_verify(self.sampler, logits, sequences)
        self.batch.record_emitted(plan.rows[plan.sampling], [result.token_ids for result in verified])
        result = _step_output(sequences, verified, prompt_logprobs)
        if self.mtp_pass is None:
            return result
        return self._with_drafts(scheduled, hidden, (query_ends - plan.counts).tolist(), result)

    def _stage_constraint_masks(self, plan: StepPlan, output: SchedulerOutput) -> None:
        """The allowed-token masks of the step's constrained sampling rows, into their device rows."""
        indices = plan.sampling[plan.constrained]
        masks = torch.stack([self.states[output.request_ids[i]].constraint.allowed_tokens() for i in indices])
        rows = torch.from_numpy(plan.rows[indices]).to(self.device)
        self.batch.extras.allowed.index_copy_(0, rows, masks.to(self.device))

    def _sequence(self, output: SchedulerOutput, index: int) -> ScheduledSequence:
        state = self.states[output.request_ids[index]]
        start = output.num_computed_tokens[index]
        count = output.num_scheduled_tokens[index]
        return ScheduledSequence(state, state.token_slice(start, start + count), start, output.sample[index])

    def _hidden(self, inputs: StepInputs, injected: InjectedEmbeddings | None = None) -> torch.Tensor:
        # The device path's backends read only the tensors; the host lists stay empty.
        metadata = [
            self.backend.build_metadata(
                StepBatch(
                    query_lens=[],
                    seq_lens=[],
                    block_tables=[],
                    page_size=self.kv_cache.page_size,
                    device=self.device,
                    tensors=tensors,
                )
            )
            for tensors in inputs.attention
        ]
        return self._forward(inputs.input_ids, inputs.attention[0].positions, metadata, injected)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: list,
        injected: InjectedEmbeddings | None = None,
    ) -> torch.Tensor:
        """The model over the step, each layer given its KV group's metadata (`metadata`, per group),
        with `injected` embeddings (a vision-language prompt's images) over their tokens'."""
        per_layer = layer_metadata(metadata, self.kv_cache.specs.group_of_layer)
        if injected is None:
            return self.model(input_ids, positions, self.kv_cache.layers, per_layer, self.backend)
        return self.model(input_ids, positions, self.kv_cache.layers, per_layer, self.backend, injected=injected)

    def _sample(
        self, logits: torch.Tensor, inputs: StepInputs, mode: str, *, verifies: bool = False
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The samples' ids (and logprobs); a step that `verifies` drafts gives -1 for each sample its
        sequence does not emit."""
        params = inputs.sampling() if mode != "greedy" else None
        tokens, logprobs = device_sampling.sample(
            logits, params, mode, rows=inputs.sample_rows, extras=self.batch.extras
        )
        if not verifies:
            self.batch.record_sampled(inputs, tokens)
            return tokens, logprobs
        emitted, ends = accept_on_device(tokens, inputs.draft_ids, inputs.first_sample)
        self.batch.record_verified(inputs, tokens, ends)
        return emitted, logprobs

    def _decode_forward(self, inputs: StepInputs, mode: str) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """One decode step from the inputs to the sampled ids: what a decode graph captures."""
        return self._sample(self.model.compute_logits(self._hidden(inputs)), inputs, mode)

    def _verify_forward(self, inputs: StepInputs, mode: str) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """One verify step from the inputs to the emitted ids: what a verify graph captures."""
        logits = self.model.compute_logits(self._hidden(inputs).index_select(0, inputs.logit_rows))
        return self._sample(logits, inputs, mode, verifies=True)

    # The reference path.

    def _execute_reference(
        self, scheduled: Sequence[ScheduledSequence], injected: InjectedEmbeddings | None = None
    ) -> StepOutput:
        input_ids = [token for s in scheduled for token in s.token_ids]
        replays = [s.state.window_replay for s in scheduled]
        replaying = any(replay is not None for replay in replays)
        group_metadata: list[AttentionMetadata] = [
            self.backend.build_metadata(
                StepBatch(
                    query_lens=[len(s.token_ids) for s in scheduled],
                    seq_lens=[s.start + len(s.token_ids) for s in scheduled],
                    block_tables=[s.state.block_ids[group] for s in scheduled],
                    page_size=self.kv_cache.page_size,
                    device=self.device,
                    first_keys=[r.start if r else 0 for r in replays] if replaying and group else None,
                    first_written=[r.end if r else 0 for r in replays] if replaying and not group else None,
                )
            )
            for group in range(len(self.kv_cache.specs.groups))
        ]
        metadata = group_metadata[0]
        num_tokens = len(input_ids)
        padding = max(self.min_rows - num_tokens, 0)
        ids = torch.tensor(input_ids + [0] * padding, dtype=torch.long, device=self.device)
        pos = metadata.positions
        if padding:
            pos = torch.cat([pos, pos.new_zeros(padding)])
        hidden = self._forward(ids, pos, group_metadata, injected)
        self.num_computed_tokens += num_tokens

        prompt_logprobs = [
            self._prompt_logprobs(s, hidden, metadata.query_start[i])
            for i, s in enumerate(scheduled)
            if s.prompt_logprobs is not None
        ]
        sampling = [(i, s) for i, s in enumerate(scheduled) if s.sample]
        if not sampling:
            if self.mtp_pass is not None:
                self.mtp_pass.run(scheduled, hidden, metadata.query_start, {})
            return StepOutput(sampled=[], prompt_logprobs=prompt_logprobs)
        # The last rows of each sampling sequence: its last token's, or with drafts, theirs too.
        rows = [
            row
            for i, s in sampling
            for row in range(metadata.query_start[i + 1] - num_rows(s), metadata.query_start[i + 1])
        ]
        sequences = [s for _, s in sampling]
        verified = sample_and_verify(self.sampler, self._logits(hidden, rows), sequences)
        output = _step_output(sequences, verified, prompt_logprobs)
        if self.mtp_pass is None:
            return output
        return self._with_drafts(scheduled, hidden, metadata.query_start, output)

    # In inference mode as launch is: the device path drafts when it reads a step's result, outside it.
    @torch.inference_mode()
    def _with_drafts(
        self,
        scheduled: Sequence[ScheduledSequence],
        hidden: torch.Tensor,
        query_starts: Sequence[int],
        output: StepOutput,
    ) -> StepOutput:
        """The step's output with the MTP pass's drafts, from the main model's final hidden states of
        the step's rows (sequence i's from query_starts[i]) and the tokens each request emitted."""
        emitted: dict[str, list[int]] = {}
        for token in output.sampled:
            emitted.setdefault(token.request_id, []).append(token.token_id)
        return replace(output, drafts=self.mtp_pass.run(scheduled, hidden, query_starts, emitted))

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of the given hidden rows; padded like the model's matmuls, for batch invariance."""
        padded = rows + [rows[-1]] * max(self.min_rows - len(rows), 0)
        return self.model.compute_logits(hidden[torch.tensor(padded, device=self.device)])[: len(rows)]

    def _prompt_logprobs(self, scheduled: ScheduledSequence, hidden: torch.Tensor, first_row: int) -> PromptLogprobs:
        """Logprobs of the prompt tokens that follow this step's positions: position p's logits
        score prompt token p + 1; the last prompt position's logits are the sampling row."""
        start = scheduled.start
        prompt = scheduled.state.prompt_token_ids
        stop = min(start + len(scheduled.token_ids), len(prompt) - 1)
        entries: list[TokenLogprobs] = []
        for chunk_start in range(start, stop, PROMPT_LOGITS_ROWS):
            chunk_stop = min(chunk_start + PROMPT_LOGITS_ROWS, stop)
            rows = list(range(first_row + chunk_start - start, first_row + chunk_stop - start))
            targets = torch.tensor(prompt[chunk_start + 1 : chunk_stop + 1], device=self.device)
            num_top = [scheduled.prompt_logprobs] * len(rows)
            entries.extend(token_logprobs(self._logits(hidden, rows), targets, num_top))
        return PromptLogprobs(request_id=scheduled.state.request_id, first_index=start + 1, entries=entries)


def embeddings_tensor(image: ImageEmbeddings) -> torch.Tensor:
    """An image's embeddings (checked at admission) as a [num_tokens, hidden] tensor, a copy."""
    dtype = getattr(torch, image.dtype)
    return torch.frombuffer(bytearray(image.data), dtype=dtype).reshape(image.shape)


def _step_output(
    sequences: Sequence[ScheduledSequence], verified: Sequence[Verified], prompt_logprobs: list[PromptLogprobs]
) -> StepOutput:
    sampled = [
        SampledToken(s.state.request_id, token, logprobs)
        for s, result in zip(sequences, verified, strict=True)
        for token, logprobs in zip(result.token_ids, result.logprobs, strict=True)
    ]
    num_accepted = {
        s.state.request_id: result.num_accepted
        for s, result in zip(sequences, verified, strict=True)
        if s.draft_token_ids
    }
    return StepOutput(sampled=sampled, prompt_logprobs=prompt_logprobs, num_accepted=num_accepted)


class _PinnedOutputs:
    """Pinned host buffers a step's sampled ids and logprobs are copied into."""

    def __init__(self, capacity: int) -> None:
        self.tokens = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.chosen = torch.empty(capacity, dtype=torch.float32, pin_memory=True)
        self.rank = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.top_ids = torch.empty(capacity, MAX_LOGPROBS, dtype=torch.int64, pin_memory=True)
        self.top_values = torch.empty(capacity, MAX_LOGPROBS, dtype=torch.float32, pin_memory=True)


class DeferredTokens:
    """Sampled ids (and logprobs) on their way to the host: one copy each into `pinned` memory (on a
    GPU; None on the CPU, where the tensors are read as they are), read after its event.
    `num_logprobs` gives each request's k (-1: none), None when no request asked."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: SampledLogprobs | None,
        request_ids: list[str],
        num_logprobs: list[int] | None,
        pinned: _PinnedOutputs | None,
        *,
        drafting: list[str] | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.num_logprobs = num_logprobs
        self.drafting = drafting
        n = len(request_ids)
        self.event = None
        if pinned is not None:
            copies = [(pinned.tokens, tokens)]
            if logprobs is not None:
                copies += [
                    (pinned.chosen, logprobs.chosen),
                    (pinned.rank, logprobs.rank),
                    (pinned.top_ids, logprobs.top_ids),
                    (pinned.top_values, logprobs.top_values),
                ]
            self.outputs = [host[:n].copy_(device[:n], non_blocking=True) for host, device in copies]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.outputs = [tokens]
            if logprobs is not None:
                self.outputs += [logprobs.chosen, logprobs.rank, logprobs.top_ids, logprobs.top_values]

    def step_output(self, prompt_logprobs: list[PromptLogprobs]) -> StepOutput:
        sampled = self.sampled()
        if self.drafting is None:
            return StepOutput(sampled=sampled, prompt_logprobs=prompt_logprobs)
        emitted = Counter(token.request_id for token in sampled)
        num_accepted = {request_id: emitted[request_id] - 1 for request_id in self.drafting}
        return StepOutput(sampled=sampled, prompt_logprobs=prompt_logprobs, num_accepted=num_accepted)

    def sampled(self) -> list[SampledToken]:
        """In sample order; of a step that verified drafts, only the samples emitted (not -1)."""
        if self.event is not None:
            self.event.synchronize()
        n = len(self.request_ids)
        values = [output[:n].tolist() for output in self.outputs]
        if self.drafting is not None:
            return [SampledToken(request_id, t, None) for request_id, t in zip(self.request_ids, values[0]) if t >= 0]
        if self.num_logprobs is None:
            return [SampledToken(request_id, token, None) for request_id, token in zip(self.request_ids, values[0])]
        return [
            SampledToken(request_id, token, logprobs_entry(token, chosen, rank, ids, top, k) if k >= 0 else None)
            for request_id, token, chosen, rank, ids, top, k in zip(self.request_ids, *values, self.num_logprobs)
        ]


class LaunchedStep:
    """A step started on the device: its output now, or `deferred` until its sampled ids are read.
    `can_defer`: the next step may be launched before this one's ids are read. `then` completes a
    deferred output once read (the MTP pass's drafts, which follow the tokens emitted)."""

    def __init__(
        self,
        output: StepOutput | None,
        deferred: DeferredTokens | None = None,
        *,
        prompt_logprobs: list[PromptLogprobs] | None = None,
        can_defer: bool = False,
        then: Callable[[StepOutput], StepOutput] | None = None,
    ) -> None:
        self._output = output
        self.deferred = deferred
        self.prompt_logprobs = prompt_logprobs or []
        self.can_defer = can_defer and deferred is not None
        self._then = then

    def result(self) -> StepOutput:
        if self._output is None:
            self._output = self.deferred.step_output(self.prompt_logprobs)
            if self._then is not None:
                self._output = self._then(self._output)
        return self._output
