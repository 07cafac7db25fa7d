"""A persistent input batch: per-request rows whose block tables live on the device.

The chain a step's requests pass through on the device path:
  SchedulerOutput (scheduler; request ids, token ids, block ids; host)
  -> InputBatch rows (this module; one row per running request, its block table kept in a pinned
     host mirror and on the device, updated only where pages were added or replaced)
  -> StepInputs (this module; the step's tokens, positions, slots, lengths, row indices and
     sampling parameters, packed into one pinned int64 buffer and sent in ONE host-to-device copy)
  -> DeviceStepTensors (kernels.attention.backend; views of that copy plus the step's block tables
     gathered on the device from the rows), read by the model, the attention backend, the sampler.

Nothing here reads device memory back, so preparing a step never waits for the GPU.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import NULL_PAGE, DeviceStepTensors
from kernels.sampling import seed_words
from workers.engine.sched.scheduler import ScheduledRequest

# Sections of the packed step buffer, each `tokens` or `seqs` long, in this order.
TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "token_rows")
SEQ_FIELDS = ("seq_lens", "query_start", "rows", "logit_rows", "greedy", "top_k", "seed_lo", "seed_hi", "step")
FLOAT_SEQ_FIELDS = ("temperature", "top_p", "min_p")  # stored as float64 bit patterns in the int64 buffer


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-sequence sampling parameters on the device, for runner.device_sampling."""

    greedy: torch.Tensor  # [seqs] bool
    temperature: torch.Tensor  # [seqs] float32, 1 for greedy rows
    top_k: torch.Tensor  # [seqs] int64, 0 = off
    top_p: torch.Tensor  # [seqs] float32, 1 = off
    min_p: torch.Tensor  # [seqs] float32, 0 = off
    seed_lo: torch.Tensor  # [seqs] int64
    seed_hi: torch.Tensor
    step: torch.Tensor  # [seqs] int64: tokens the request has sampled so far


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [tokens] int64, pending tokens already replaced by their sampled ids
    attention: DeviceStepTensors
    rows: torch.Tensor  # [seqs] int64: each sequence's row in the input batch
    logit_rows: torch.Tensor  # [seqs] int64: each sequence's last token row (its logits row)
    sampling: SamplingTensors


class PackedLayout:
    """Offsets of each field in a packed buffer sized for `tokens` tokens and `seqs` sequences."""

    def __init__(self, tokens: int, seqs: int) -> None:
        self.tokens, self.seqs = tokens, seqs
        self.slices: dict[str, slice] = {}
        offset = 0
        for name in TOKEN_FIELDS:
            self.slices[name] = slice(offset, offset + tokens)
            offset += tokens
        for name in SEQ_FIELDS + FLOAT_SEQ_FIELDS:
            size = seqs + 1 if name == "query_start" else seqs
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.size = offset


class InputBatch:
    """Rows for up to `max_rows` requests; row `max_rows` is the padding row (all NULL_PAGE)."""

    def __init__(self, *, max_rows: int, max_pages: int, page_size: int, device: torch.device, seed: int) -> None:
        self.max_rows = max_rows
        self.page_size = page_size
        self.device = device
        pin = device.type == "cuda"
        self.tables_host = torch.full((max_rows + 1, max_pages), NULL_PAGE, dtype=torch.int32, pin_memory=pin)
        self.tables_np = self.tables_host.numpy()
        self.tables = self.tables_host.to(device)
        self.row_of: dict[str, int] = {}
        self.row_pages: list[list[int]] = [[] for _ in range(max_rows + 1)]
        self.row_seed: list[tuple[int, int]] = [(0, 0)] * (max_rows + 1)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self._changed: set[int] = set()
        # Pinned staging, two of each used in turn: with async scheduling the host fills step N+1's
        # while step N's copies may still be queued; step N-1's have finished by then.
        self._changed_index = [torch.empty(max_rows + 1, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._changed_rows = [torch.empty_like(self.tables_host, pin_memory=pin) for _ in range(2)]
        self._staging = [torch.empty(0, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._pin = pin
        # Each row's last sampled token, written on the device by every step: a pending token
        # (request.PENDING_TOKEN) in the next step's input is read from here.
        self.last_tokens = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        # Seeds for requests that have none: reproducible for a given engine seed and arrival order.
        self._random = random.Random(seed)

    @property
    def padding_row(self) -> int:
        return self.max_rows

    def release(self, request_ids: Sequence[str]) -> None:
        """Free the rows of finished, aborted, transferred or preempted requests."""
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.row_pages[row] = []
                self.free_rows.append(row)

    def _row(self, scheduled: ScheduledRequest) -> int:
        row = self.row_of.get(scheduled.request_id)
        if row is None:
            if not self.free_rows:
                raise RuntimeError(f"input batch is full ({self.max_rows} rows)")
            row = self.free_rows.pop()
            self.row_of[scheduled.request_id] = row
            seed = scheduled.params.seed if scheduled.params.seed is not None else self._random.getrandbits(64)
            self.row_seed[row] = seed_words(seed)
        table, known = scheduled.block_table, self.row_pages[row]
        if len(table) != len(known) or table[-1:] != known[-1:]:
            start = len(known) if table[: len(known)] == known else 0
            self.tables_np[row, start : len(table)] = table[start:]
            self.tables_np[row, len(table) :] = NULL_PAGE
            self.row_pages[row] = list(table)
            self._changed.add(row)
        return row

    def prepare(
        self, scheduled: Sequence[ScheduledRequest], *, pad_to: int | None = None
    ) -> tuple[PackedLayout, torch.Tensor]:
        """Rows for the step's requests, the changed block-table rows sent to the device, and the
        step's packed host buffer (a pinned int64 tensor). `pad_to` pads a decode step to a graph
        bucket with sequences of length 0 on the padding row."""
        self._turn ^= 1
        rows = [self._row(s) for s in scheduled]
        self._send_changed_rows()
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=len(scheduled))
        num_tokens = int(query_lens.sum())
        seqs = pad_to or len(scheduled)
        tokens = pad_to or num_tokens
        layout = PackedLayout(tokens, seqs)
        staging = self._staging[self._turn]
        if staging.numel() < layout.size:
            size = max(layout.size, 2 * staging.numel())
            staging = self._staging[self._turn] = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
        packed = staging[: layout.size].numpy()
        fields = {name: packed[cut] for name, cut in layout.slices.items()}
        starts = np.fromiter((s.start_position for s in scheduled), dtype=np.int64, count=len(scheduled))
        rows_np = np.asarray(rows, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(len(scheduled)), query_lens)
        query_start = np.concatenate([[0], np.cumsum(query_lens)])
        positions = np.arange(num_tokens) - query_start[seq_of_token] + starts[seq_of_token]
        fields["input_ids"][:num_tokens] = [t for s in scheduled for t in s.token_ids]
        fields["positions"][:num_tokens] = positions
        page = self.tables_np[rows_np[seq_of_token], positions // self.page_size]
        fields["slot_mapping"][:num_tokens] = page * self.page_size + positions % self.page_size
        fields["token_rows"][:num_tokens] = rows_np[seq_of_token]
        n = len(scheduled)
        fields["seq_lens"][:n] = starts + query_lens
        fields["query_start"][: n + 1] = query_start
        fields["rows"][:n] = rows_np
        fields["logit_rows"][:n] = query_start[1:] - 1
        self._fill_sampling(fields, scheduled, rows)
        if seqs > n or tokens > num_tokens:
            self._fill_padding(fields, layout, n, num_tokens)
        return layout, staging[: layout.size]

    def _fill_sampling(
        self, fields: dict[str, np.ndarray], scheduled: Sequence[ScheduledRequest], rows: list[int]
    ) -> None:
        n = len(scheduled)
        params = [s.params for s in scheduled]
        greedy = np.fromiter((p.temperature == 0 for p in params), dtype=bool, count=n)
        fields["greedy"][:n] = greedy
        fields["top_k"][:n] = [max(p.top_k, 0) for p in params]
        fields["seed_lo"][:n] = [self.row_seed[row][0] for row in rows]
        fields["seed_hi"][:n] = [self.row_seed[row][1] for row in rows]
        fields["step"][:n] = [len(s.output_token_ids) for s in scheduled]
        fields["temperature"].view(np.float64)[:n] = np.where(greedy, 1.0, [p.temperature for p in params])
        fields["top_p"].view(np.float64)[:n] = [p.top_p for p in params]
        fields["min_p"].view(np.float64)[:n] = [p.min_p for p in params]

    def _fill_padding(self, fields: dict[str, np.ndarray], layout: PackedLayout, n: int, num_tokens: int) -> None:
        """Padding sequences: one token each on the padding row, length 0 (attention writes zeros),
        slot -1 (nothing is written to the cache), greedy."""
        fields["input_ids"][num_tokens:] = 0
        fields["positions"][num_tokens:] = 0
        fields["slot_mapping"][num_tokens:] = -1
        fields["token_rows"][num_tokens:] = self.padding_row
        fields["seq_lens"][n:] = 0
        fields["query_start"][n + 1 :] = num_tokens + np.arange(1, layout.seqs - n + 1)
        fields["rows"][n:] = self.padding_row
        fields["logit_rows"][n:] = np.minimum(np.arange(num_tokens, num_tokens + layout.seqs - n), layout.tokens - 1)
        for name in ("greedy", "seed_lo", "seed_hi", "step", "top_k"):
            fields[name][n:] = 1 if name == "greedy" else 0
        for name, value in (("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0)):
            fields[name].view(np.float64)[n:] = value

    def _send_changed_rows(self) -> None:
        if not self._changed:
            return
        changed = sorted(self._changed)
        self._changed.clear()
        if len(changed) * 2 > self.max_rows:
            self.tables.copy_(self.tables_host, non_blocking=True)
            return
        index = self._changed_index[self._turn][: len(changed)]
        index.numpy()[:] = changed
        staged = torch.index_select(self.tables_host, 0, index, out=self._changed_rows[self._turn][: len(changed)])
        self.tables.index_copy_(0, index.to(self.device, non_blocking=True), staged.to(self.device, non_blocking=True))

    def step_inputs(
        self, layout: PackedLayout, device_buffer: torch.Tensor, *, decode_only: bool, max_query_len: int
    ) -> StepInputs:
        """Views of a device copy of the packed buffer, and the step's block tables gathered from the rows."""
        view = {name: device_buffer[cut] for name, cut in layout.slices.items()}
        as_float = {name: view[name].view(torch.float64).to(torch.float32) for name in FLOAT_SEQ_FIELDS}
        attention = DeviceStepTensors(
            positions=view["positions"],
            slot_mapping=view["slot_mapping"],
            seq_lens=view["seq_lens"].to(torch.int32),
            query_start=view["query_start"].to(torch.int32),
            block_tables=self.tables.index_select(0, view["rows"]),
            max_query_len=max_query_len,
            decode_only=decode_only,
        )
        sampling = SamplingTensors(
            greedy=view["greedy"].bool(),
            temperature=as_float["temperature"],
            top_k=view["top_k"],
            top_p=as_float["top_p"],
            min_p=as_float["min_p"],
            seed_lo=view["seed_lo"],
            seed_hi=view["seed_hi"],
            step=view["step"],
        )
        ids = view["input_ids"]
        input_ids = torch.where(ids < 0, self.last_tokens.index_select(0, view["token_rows"]), ids)
        return StepInputs(
            input_ids=input_ids,
            attention=attention,
            rows=view["rows"],
            logit_rows=view["logit_rows"],
            sampling=sampling,
        )

    def record_sampled(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Keep each sequence's sampled token on the device for a pending token of the next step."""
        self.last_tokens.index_copy_(0, inputs.rows, tokens)
