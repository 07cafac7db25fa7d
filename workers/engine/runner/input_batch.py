"""A persistent input batch: per-request rows whose block tables and sampling settings stay put.

The chain a step's requests pass through on the device path:
  SchedulerOutput (scheduler; request ids, token counts, block-id diffs; host)
  -> InputBatch rows (this module; one row per running request: its block table of each KV group in a
     pinned host mirror and on the device, its sampling settings in host arrays, updated only when a
     request arrives or gets pages)
  -> StepPlan (this module; the step's rows, counts and positions as numpy arrays, built with
     vectorised ops over the rows, not per-request Python)
  -> StepInputs (this module; the step's tokens, positions, slots of each KV group, lengths, row
     indices and the sampling parameters of the sequences that sample, packed into one pinned int64
     buffer and sent in ONE host-to-device copy)
  -> DeviceStepTensors, one per KV group (kernels.attention.backend; views of that copy plus the
     step's block tables of the group gathered on the device from the rows), read by the model, the
     attention backend, the sampler. The groups share every field but their slots and block tables.

A decode token is usually the one the previous step sampled for the row, which stays on the device
(`last_tokens`): such a token, and a pending one (request.PENDING_TOKEN) in a request's output, is
read there, so decoding needs no token ids from the host. Nothing here reads device memory back, so
preparing a step never waits for the GPU.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import NULL_PAGE, DeviceStepTensors
from kernels.sampling import seed_words
from workers.engine.runner.device_sampling import SamplingExtras, SamplingTensors, needs_extras
from workers.engine.runner.request_states import RequestState, RequestStates
from workers.engine.sched.output import SchedulerOutput
from workers.protocol.sampling_params import SamplingParams

# Sections of the packed step buffer, each `tokens`, `seqs` or `samples` long, in this order
# ("slot_mapping" is `tokens` long per KV group: [groups, tokens]).
TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "token_rows")
SEQ_FIELDS = ("seq_lens", "query_start", "rows", "first_keys")
SAMPLE_FIELDS = (
    "logit_rows",
    "sample_rows",
    "greedy",
    "top_k",
    "seed_lo",
    "seed_hi",
    "step",
    "draft_ids",
    "first_sample",
)
# Stored as float64 bit patterns in the int64 buffer.
FLOAT_SAMPLE_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [tokens] int64, tokens kept on the device already filled in
    attention: tuple[DeviceStepTensors, ...]  # per KV group
    logit_rows: torch.Tensor  # [samples] int64: the token row whose logits each sample reads
    sample_rows: torch.Tensor  # [samples] int64: the input-batch row of each sample's sequence
    sample_fields: dict[str, torch.Tensor]  # the packed buffer's views of the sampling parameters
    # [samples] int64: the draft each sample is checked against (-1 after a sequence's last draft),
    # and the index of its sequence's first sample (runner.verify.accept_on_device).
    draft_ids: torch.Tensor
    first_sample: torch.Tensor

    def sampling(self) -> SamplingTensors:
        """The sampling parameters as the sampler takes them. Built on demand: a greedy step (or its
        CUDA graph) needs none of them, and each conversion is a kernel."""
        fields = self.sample_fields
        as_float = {name: fields[name].view(torch.float64).to(torch.float32) for name in FLOAT_SAMPLE_FIELDS}
        return SamplingTensors(
            greedy=fields["greedy"].bool(),
            top_k=fields["top_k"],
            seed_lo=fields["seed_lo"],
            seed_hi=fields["seed_hi"],
            step=fields["step"],
            **as_float,
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step over the batch's rows, as host arrays (sequences in the scheduler's order)."""

    rows: np.ndarray  # [seqs] each sequence's row
    counts: np.ndarray  # [seqs] tokens it computes
    starts: np.ndarray  # [seqs] its first position
    sampling: np.ndarray  # indices of the sequences that sample, in order
    mode: str  # the least device_sampling mode the sampling sequences need
    constrained: np.ndarray  # of those, the indices (into `sampling`) whose output a constraint masks
    decode_only: bool  # every sequence computes one token and samples, none reports prompt logprobs
    prompt_logprobs: list[int]  # sequences reporting prompt logprobs this step
    # [seqs] the drafts each sequence verifies (the last of its tokens); all 0 in a step without any.
    draft_counts: np.ndarray
    # Every sequence computes its last token and its drafts and samples at each, some have drafts,
    # none reports prompt logprobs: the step a verify graph replays.
    verify_only: bool = False

    @classmethod
    def empty(cls) -> "StepPlan":
        """No sequences: what a CUDA graph is captured over, every sequence padding."""
        none = np.zeros(0, dtype=np.int64)
        return cls(
            none,
            none,
            none,
            none,
            mode="greedy",
            constrained=none,
            decode_only=True,
            prompt_logprobs=[],
            draft_counts=none,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def samples_per_sequence(self) -> np.ndarray:
        """[sampling] rows each sampling sequence samples: one per draft, and the one after them."""
        return self.draft_counts[self.sampling] + 1

    @property
    def num_samples(self) -> int:
        return len(self.sampling) + int(self.draft_counts[self.sampling].sum())

    @property
    def max_query_len(self) -> int:
        return int(self.counts.max())


class PackedLayout:
    """Offsets of each field in a packed buffer for `tokens` tokens, `seqs` sequences and `samples`
    sampling sequences of a cache of `groups` KV groups."""

    def __init__(self, tokens: int, seqs: int, samples: int, groups: int = 1) -> None:
        self.tokens, self.seqs, self.samples, self.groups = tokens, seqs, samples, groups
        self.slices: dict[str, slice] = {}
        offset = 0
        sizes = [(name, tokens * groups if name == "slot_mapping" else tokens) for name in TOKEN_FIELDS]
        sizes += [(name, seqs + 1 if name == "query_start" else seqs) for name in SEQ_FIELDS]
        sizes += [(name, samples) for name in SAMPLE_FIELDS + FLOAT_SAMPLE_FIELDS]
        for name, size in sizes:
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.size = offset


class InputBatch:
    """Rows for up to `max_rows` requests; row `max_rows` is the padding row (all NULL_PAGE). A row's
    block tables are [groups, max_pages]: one per KV group, each indexed by token position."""

    def __init__(
        self,
        *,
        max_rows: int,
        max_pages: int,
        page_size: int,
        vocab_size: int,
        device: torch.device,
        seed: int,
        num_groups: int = 1,
    ) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.device = device
        self.num_groups = num_groups
        pin = device.type == "cuda"
        size = max_rows + 1
        self.tables_host = torch.full((size, num_groups, max_pages), NULL_PAGE, dtype=torch.int32, pin_memory=pin)
        self.tables_np = self.tables_host.numpy()
        self.tables = self.tables_host.to(device)
        self.row_of: dict[str, int] = {}
        self.num_row_pages = np.zeros(size, dtype=np.int64)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self._changed: set[int] = set()
        # Per-row settings, written when a request gets its row.
        self.prompt_len = np.zeros(size, dtype=np.int64)
        # A window replay's bounds (kv.window_replay; 0, 0 without one): the window groups' first
        # readable key, and the position before which the full group writes nothing.
        self.replay_start = np.zeros(size, dtype=np.int64)
        self.replay_end = np.zeros(size, dtype=np.int64)
        self.greedy = np.ones(size, dtype=np.int64)
        self.top_k = np.zeros(size, dtype=np.int64)
        self.seed_lo = np.zeros(size, dtype=np.int64)
        self.seed_hi = np.zeros(size, dtype=np.int64)
        self.temperature = np.ones(size, dtype=np.float64)
        self.top_p = np.ones(size, dtype=np.float64)
        self.min_p = np.zeros(size, dtype=np.float64)
        self.repetition_penalty = np.ones(size, dtype=np.float64)
        self.frequency_penalty = np.zeros(size, dtype=np.float64)
        self.presence_penalty = np.zeros(size, dtype=np.float64)
        self.needs_extras = np.zeros(size, dtype=bool)  # bias, penalties or a mask
        self.constrained = np.zeros(size, dtype=bool)
        self.logprobs = np.full(size, -1, dtype=np.int64)  # top alternatives per sampled token; -1: none
        self.reports_prompt_logprobs = np.zeros(size, dtype=bool)  # asked for prompt logprobs
        # The rows' sampling history on the device, from the first request that needs it on.
        self.extras: SamplingExtras | None = None
        # Whether last_tokens[row] holds the token at the row's next position (the row sampled last).
        self.token_on_device = np.zeros(size, dtype=bool)
        # Pinned staging the host fills while the device may still be copying out of the other slot.
        self._staging = [_StagingSlot(size, self.tables_host, pin) for _ in range(2)]
        self._turn = 0
        # Each row's last sampled token, written on the device by every step that samples for it.
        self.last_tokens = torch.zeros(size, dtype=torch.int64, device=device)
        # Seeds for requests that have none: reproducible for a given engine seed and arrival order.
        self._random = random.Random(seed)

    @property
    def padding_row(self) -> int:
        return self.max_rows

    def update(self, output: SchedulerOutput, dropped: Sequence[str]) -> None:
        """Free the rows of dropped requests, give new ones rows, extend the tables of the others."""
        for request_id in dropped:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.free_rows.append(row)
        for new in output.new_requests:
            if len(new.block_ids) != self.num_groups:
                raise ValueError(f"the input batch holds {self.num_groups} KV-cache groups, got {len(new.block_ids)}")
            row = self._add(new.request_id, new.params, len(new.prompt_token_ids), new.prompt_logprobs is not None)
            self._set_tables(row, new.block_ids, start=0)
            replay = new.window_replay
            self.replay_start[row], self.replay_end[row] = (replay.start, replay.end) if replay else (0, 0)
            params = new.params
            self.needs_extras[row] = needs_extras(params, new.constraint is not None)
            self.constrained[row] = new.constraint is not None
            self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
            if self.extras is None and (self.needs_extras[row] or params.logprobs is not None):
                self.extras = SamplingExtras(self.max_rows + 1, self.vocab_size, self.device)
            if self.extras is not None:
                # Every new row, extras or not: an "extras" step reads every row's bias and mask, and
                # the request that had this row before may have left its own there.
                history = (new.prompt_token_ids, new.output_token_ids) if self.needs_extras[row] else ([], [])
                self.extras.reset_row(row, params, *history)
        for request_id, added in output.new_block_ids.items():
            row = self.row_of[request_id]
            self._set_tables(row, added, start=int(self.num_row_pages[row]))

    def _add(self, request_id: str, params: SamplingParams, prompt_len: int, reports_prompt_logprobs: bool) -> int:
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_rows} rows)")
        row = self.free_rows.pop()
        self.row_of[request_id] = row
        seed = params.seed if params.seed is not None else self._random.getrandbits(64)
        self.seed_lo[row], self.seed_hi[row] = seed_words(seed)
        greedy = params.temperature == 0
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = max(params.top_k, 0)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.prompt_len[row] = prompt_len
        self.reports_prompt_logprobs[row] = reports_prompt_logprobs
        self.token_on_device[row] = False
        self.num_row_pages[row] = 0
        return row

    def _set_tables(self, row: int, tables: Sequence[list[int]], *, start: int) -> None:
        """Write each group's pages from position `start` on (the groups' tables are equally long)."""
        end = start + len(tables[0])
        self.tables_np[row, :, start:end] = tables
        if start == 0:
            self.tables_np[row, :, end:] = NULL_PAGE
        self.num_row_pages[row] = end
        self._changed.add(row)

    def plan(self, output: SchedulerOutput, states: RequestStates) -> StepPlan:
        n = len(output.request_ids)
        row_of = self.row_of
        rows = np.fromiter((row_of[request_id] for request_id in output.request_ids), dtype=np.int64, count=n)
        counts = np.asarray(output.num_scheduled_tokens, dtype=np.int64)
        starts = np.asarray(output.num_computed_tokens, dtype=np.int64)
        sample = np.asarray(output.sample, dtype=bool)
        sampling = np.flatnonzero(sample)
        sample_rows = rows[sampling]
        prompt_logprobs = [
            int(i)
            for i in np.flatnonzero(self.reports_prompt_logprobs[rows])
            if states[output.request_ids[i]].reports_prompt_logprobs
        ]
        if (self.logprobs[sample_rows] >= 0).any():
            mode = "logprobs"
        elif self.needs_extras[sample_rows].any():
            mode = "extras"
        else:
            mode = "greedy" if self.greedy[sample_rows].all() else "sample"
        drafts = output.draft_token_ids
        draft_counts = (
            np.fromiter((len(drafts.get(request_id, ())) for request_id in output.request_ids), np.int64, count=n)
            if drafts
            else np.zeros(n, dtype=np.int64)
        )
        all_sample = bool(n) and bool(sample.all()) and not prompt_logprobs
        return StepPlan(
            rows=rows,
            counts=counts,
            starts=starts,
            sampling=sampling,
            mode=mode,
            constrained=np.flatnonzero(self.constrained[sample_rows]),
            decode_only=all_sample and bool((counts == 1).all()),
            prompt_logprobs=prompt_logprobs,
            draft_counts=draft_counts,
            verify_only=all_sample and bool(drafts) and bool((counts == draft_counts + 1).all()),
        )

    def prepare(
        self,
        plan: StepPlan,
        output: SchedulerOutput,
        states: RequestStates,
        *,
        pad_to: PackedLayout | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[PackedLayout, torch.Tensor]:
        """Send the changed block-table rows to the device, fill the step's packed buffer and send it in
        one host-to-device copy: into `out` (a device buffer of the layout's size, such as a CUDA
        graph's static input) or a new device tensor, returned. `pad_to` pads the step to a graph
        bucket's layout (_fill_padding).

        Each sampling sequence samples at its last token and, when it verifies drafts, at each token
        before them (its drafts' positions): sample j of a sequence with d drafts reads the logits of
        its token d - j from the end, is checked against draft j (none after the last), and draws the
        noise of the request's step that position would have without speculation."""
        self._turn ^= 1
        slot = self._staging[self._turn]
        slot.wait_until_sent()
        self._send_changed_rows(slot)
        n = len(plan.rows)
        num_tokens = plan.num_tokens
        num_samples = plan.num_samples
        layout = pad_to or PackedLayout(num_tokens, n, num_samples, self.num_groups)
        staged = slot.packed(layout.size)
        packed = staged.numpy()
        fields = {name: packed[cut] for name, cut in layout.slices.items()}
        rows, counts, starts = plan.rows, plan.counts, plan.starts
        seq_of_token = np.repeat(np.arange(n), counts)
        query_start = np.concatenate([[0], np.cumsum(counts)])
        positions = np.arange(num_tokens) - query_start[seq_of_token] + starts[seq_of_token]
        self._fill_tokens(fields["input_ids"], plan, output, states, query_start)
        fields["positions"][:num_tokens] = positions
        slots = fields["slot_mapping"].reshape(self.num_groups, layout.tokens)
        page = self.tables_np[rows[seq_of_token], :, positions // self.page_size]  # [tokens, groups]
        slots[:, :num_tokens] = (page * self.page_size + (positions % self.page_size)[:, None]).T
        slots[0, :num_tokens][positions < self.replay_end[rows[seq_of_token]]] = -1
        fields["token_rows"][:num_tokens] = rows[seq_of_token]
        fields["seq_lens"][:n] = starts + counts
        fields["query_start"][: n + 1] = query_start
        fields["rows"][:n] = rows
        fields["first_keys"][:n] = self.replay_start[rows]
        sampling = plan.sampling
        per_sequence = plan.samples_per_sequence
        first = np.cumsum(per_sequence) - per_sequence  # each sequence's first sample
        index = np.arange(num_samples) - np.repeat(first, per_sequence)  # of each sample in its sequence
        sample_rows = np.repeat(rows[sampling], per_sequence)
        # Sample j of a sequence reads the row of its draft j's position: that draft's predecessor.
        logit_rows = np.repeat(query_start[sampling + 1] - per_sequence, per_sequence) + index
        fields["logit_rows"][:num_samples] = logit_rows
        fields["sample_rows"][:num_samples] = sample_rows
        for name in ("greedy", "top_k", "seed_lo", "seed_hi"):
            fields[name][:num_samples] = getattr(self, name)[sample_rows]
        # The tokens the request had sampled before each sample's token (at the position after its row's).
        fields["step"][:num_samples] = positions[logit_rows] + 1 - self.prompt_len[sample_rows]
        is_last = index == np.repeat(per_sequence - 1, per_sequence)
        fields["draft_ids"][:num_samples] = np.where(
            is_last, -1, fields["input_ids"][np.minimum(logit_rows + 1, max(num_tokens - 1, 0))]
        )
        fields["first_sample"][:num_samples] = np.repeat(first, per_sequence)
        for name in FLOAT_SAMPLE_FIELDS:
            fields[name].view(np.float64)[:num_samples] = getattr(self, name)[sample_rows]
        if pad_to is not None:
            self._fill_padding(fields, layout, n, num_tokens, num_samples)
        # After this step, the rows that sample hold their next token on the device.
        self.token_on_device[rows] = False
        self.token_on_device[sample_rows] = True
        if out is None:
            sent = staged.to(self.device, non_blocking=True)
        else:
            sent = out.copy_(staged, non_blocking=True)
        slot.sent()
        return layout, sent

    def _fill_tokens(
        self,
        input_ids: np.ndarray,
        plan: StepPlan,
        output: SchedulerOutput,
        states: RequestStates,
        query_start: np.ndarray,
    ) -> None:
        """-1 (read on the device) for a one-token step whose token the row sampled last; the other
        sequences' tokens from their requests (a pending token among them is -1 there too)."""
        kept = (plan.counts == 1) & self.token_on_device[plan.rows]
        input_ids[query_start[:-1][kept]] = -1
        for i in np.flatnonzero(~kept):
            request_id = output.request_ids[i]
            state: RequestState = states[request_id]
            start = int(plan.starts[i])
            stop = start + int(plan.counts[i])
            drafts = output.draft_token_ids.get(request_id)
            tokens = state.token_slice(start, stop - len(drafts)) + drafts if drafts else state.token_slice(start, stop)
            input_ids[query_start[i] : query_start[i + 1]] = tokens

    def _fill_padding(
        self, fields: dict[str, np.ndarray], layout: PackedLayout, n: int, num_tokens: int, samples: int
    ) -> None:
        """Padding up to a graph bucket's layout, on the padding row: the padding sequences take one
        padding token each while both last (a decode bucket pads this way only), the rest have none,
        and tokens left over belong to no sequence (attention leaves their rows zero). Padding tokens
        have slot -1 (nothing is written to the cache), padding sequences length 0 (nothing is read);
        each padding sample reads a padding token's row (the last, when there are fewer), greedily."""
        padding_seqs = layout.seqs - n
        owned = min(layout.tokens - num_tokens, padding_seqs)  # padding tokens that have a sequence
        fields["input_ids"][num_tokens:] = 0
        fields["positions"][num_tokens:] = 0
        fields["slot_mapping"].reshape(self.num_groups, layout.tokens)[:, num_tokens:] = -1
        fields["token_rows"][num_tokens:] = self.padding_row
        fields["seq_lens"][n:] = 0
        fields["query_start"][n + 1 :] = num_tokens + np.minimum(np.arange(1, padding_seqs + 1), owned)
        fields["rows"][n:] = self.padding_row
        fields["first_keys"][n:] = 0
        padding_samples = np.arange(samples, layout.samples)
        fields["logit_rows"][samples:] = np.minimum(num_tokens + padding_samples - samples, layout.tokens - 1)
        fields["sample_rows"][samples:] = self.padding_row
        for name in ("greedy", "seed_lo", "seed_hi", "step", "top_k"):
            fields[name][samples:] = 1 if name == "greedy" else 0
        fields["draft_ids"][samples:] = -1
        fields["first_sample"][samples:] = padding_samples
        for name, value in (("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            fields[name].view(np.float64)[samples:] = value
        for name in ("frequency_penalty", "presence_penalty"):
            fields[name].view(np.float64)[samples:] = 0.0

    def _send_changed_rows(self, slot: "_StagingSlot") -> None:
        if not self._changed:
            return
        changed = sorted(self._changed)
        self._changed.clear()
        # Staged, never copied from tables_host itself: the host changes it for the next step while
        # this copy may still be queued behind the running step.
        index = slot.changed_index[: len(changed)]
        index.numpy()[:] = changed
        staged = torch.index_select(self.tables_host, 0, index, out=slot.changed_rows[: len(changed)])
        self.tables.index_copy_(0, index.to(self.device, non_blocking=True), staged.to(self.device, non_blocking=True))

    def step_inputs(
        self, layout: PackedLayout, device_buffer: torch.Tensor, *, decode_only: bool, max_query_len: int
    ) -> StepInputs:
        """Views of a device copy of the packed buffer, and the step's block tables of each KV group
        gathered from the rows."""
        view = {name: device_buffer[cut] for name, cut in layout.slices.items()}
        slots = view["slot_mapping"].view(self.num_groups, layout.tokens)
        tables = self.tables.index_select(0, view["rows"])  # [seqs, groups, max_pages]
        seq_lens = view["seq_lens"].to(torch.int32)
        query_start = view["query_start"].to(torch.int32)
        first_keys = view["first_keys"].to(torch.int32) if self.num_groups > 1 else None
        attention = tuple(
            DeviceStepTensors(
                positions=view["positions"],
                slot_mapping=slots[group],
                seq_lens=seq_lens,
                query_start=query_start,
                block_tables=tables[:, group].contiguous(),
                max_query_len=max_query_len,
                decode_only=decode_only,
                first_keys=first_keys if group else None,
            )
            for group in range(self.num_groups)
        )
        ids = view["input_ids"]
        input_ids = torch.where(ids < 0, self.last_tokens.index_select(0, view["token_rows"]), ids)
        return StepInputs(
            input_ids=input_ids,
            attention=attention,
            logit_rows=view["logit_rows"],
            sample_rows=view["sample_rows"],
            sample_fields={name: view[name] for name in SAMPLE_FIELDS + FLOAT_SAMPLE_FIELDS},
            draft_ids=view["draft_ids"],
            first_sample=view["first_sample"],
        )

    def record_sampled(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Keep each sampling sequence's token on the device for the row's next step."""
        self.last_tokens.index_copy_(0, inputs.sample_rows, tokens)

    def record_verified(self, inputs: StepInputs, tokens: torch.Tensor, ends: torch.Tensor) -> None:
        """After a step verified on the device: each sequence's last emitted token (its sample where
        `ends`) is its row's next input. The other samples write to the padding row, so the copy
        needs no host sync to pick them out."""
        targets = torch.where(ends, inputs.sample_rows, self.padding_row)
        self.last_tokens.index_copy_(0, targets, tokens)

    def record_emitted(self, rows: np.ndarray, emitted: Sequence[list[int]]) -> None:
        """After a step sampled on the host (one that verified drafts): each row's last emitted token
        is its next input, and every emitted token joins the row's sampling history, as the device
        sampler records its own."""
        last = torch.tensor([tokens[-1] for tokens in emitted], dtype=torch.int64)
        self.last_tokens.index_copy_(0, torch.from_numpy(rows).to(self.device), last.to(self.device))
        if self.extras is not None:
            history_rows = torch.from_numpy(np.repeat(rows, [len(tokens) for tokens in emitted])).to(self.device)
            tokens = torch.tensor([token for row_tokens in emitted for token in row_tokens], dtype=torch.int64)
            self.extras.record(history_rows, tokens.to(self.device))


class _StagingSlot:
    """Pinned host buffers of one step's copies to the device: the changed block-table rows and the
    packed step buffer. Asynchronous copies read them when the device gets to them, which can be
    steps after the host queued them (steps that sample nothing never wait for the device), so a
    slot is filled again only once the copies of its last use have run (`wait_until_sent`)."""

    def __init__(self, rows: int, tables_host: torch.Tensor, pin: bool) -> None:
        self.pin = pin
        self.changed_index = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.changed_rows = torch.empty_like(tables_host, pin_memory=pin)
        self._packed = torch.empty(0, dtype=torch.int64, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._pending = False

    def packed(self, size: int) -> torch.Tensor:
        """The slot's packed buffer, `size` long (grown, doubling, when too short)."""
        if self._packed.numel() < size:
            self._packed = torch.empty(max(size, 2 * self._packed.numel()), dtype=torch.int64, pin_memory=self.pin)
        return self._packed[:size]

    def sent(self) -> None:
        """The slot's copies are queued: mark where they end on the stream."""
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def wait_until_sent(self) -> None:
        if self._pending:
            self._copied.synchronize()
            self._pending = False
