"""EPEngine: an engine of EP size N as N processes, driven from rank 0 (the worker process), behind
the engine interface (workers.engine.engine_core) so the worker serves it like any engine.

Rank 0 runs its own LLMEngine here and starts ranks 1..N-1 (workers.engine.expert_parallel.rank_process),
each with a pipe. Attention is data-parallel: every rank schedules and serves its own requests;
rank 0 checks each new request (its own admission rules are every rank's) and gives it to the rank
with the fewest requests in flight (constrained requests stay on rank 0, whose engine compiles and
holds their grammar); the EngineRequest goes to its rank as it came. One `step()` is one lockstep
step: rank 0 sends every rank its command (new requests, aborts, a placement to put in force, whether
to report load), all ranks step together (a rank with nothing to run joins the collectives with an
empty pass), and every rank answers with its outputs and state.
No rank steps unless one has work.

A rank that dies (its process exits, or a collective fails because a peer did) triggers a resize:
the survivors meet at a new rendezvous, take a placement that covers every logical expert on them
(workers.eplb over the load counted so far),
and every request in flight is resubmitted from its prompt plus the tokens already streamed, so a
greedy stream goes on with the same tokens. The resize is recorded (resized_at, resize_reason).
"""

import dataclasses
import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import msgspec
import torch

from workers.args import EngineArgs
from workers.engine.admission import check_cache_hints
from workers.engine.builder import build_rank_engine
from workers.engine.engine import grammar_compiler
from workers.engine.engine_core import EngineCore, EngineStats, EPGroupState
from workers.engine.expert_parallel.in_flight import InFlight, aborted, report_deltas
from workers.engine.expert_parallel.load_window import LoadWindow
from workers.engine.expert_parallel.rank import RankEngine, moe_blocks, num_logical_experts
from workers.engine.expert_parallel.rank_process import run_rank_process
from workers.engine.kv_handoff import KVHandoff
from workers.engine.outputs import RequestDelta
from workers.engine.parallel.groups import Rendezvous, join_group
from workers.engine.parallel.placement import (
    Placement,
    PlacementError,
    check_placement,
    round_robin_placement,
    slots_for,
)
from workers.engine.structured.constraint import TokenConstraint
from workers.eplb import place_experts
from workers.protocol.engine_request import ComputePrompt, EngineRequest
from workers.protocol.ep_rank import EPGroupSpec, EPRankCommand, EPRankMessage, EPRankReport
from workers.protocol.errors import EngineOverloadedError, InvalidRequestError
from workers.protocol.messages import OutputConstraintSpec

log = logging.getLogger(__name__)

# Ranks are forked from a fork server, not from the worker process, which has threads (heartbeats,
# ZMQ, OpenMP) a fork would copy mid-flight; the server imports the rank's modules once, so a rank
# starts without importing torch again.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["workers.engine.expert_parallel.rank_process"])
# Longest rank 0 waits for a live rank's report of one step (a long prefill on a CPU takes seconds).
REPORT_TIMEOUT_S = 300.0
# How often the ranks' expert load counters are read into the window heartbeats take.
LOAD_INTERVAL_S = 0.1


@dataclass(slots=True)
class _RemoteRank:
    process: multiprocessing.Process
    pipe: Connection
    report: EPRankReport
    commands: list[EngineRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class RankFailedError(RuntimeError):
    """A rank died or its step failed."""


class EPEngine(EngineCore):
    def __init__(self, args: EngineArgs) -> None:
        # Eager: a variable-size all-to-all reads its counts on the host, which a CUDA graph cannot.
        args = dataclasses.replace(args, enforce_eager=True)
        self.args = args
        self.device = torch.device(args.device)
        size = args.ep_size
        local = build_rank_engine(args, compile_constraint=self._compiled_constraint)
        self._compile = grammar_compiler(local.tokenizer, local.model_config.vocab_size)
        self.num_layers = len(moe_blocks(local.runner.model))
        self.num_experts = num_logical_experts(local.runner.model)
        slots = args.ep_slots_per_rank or slots_for(self.num_experts, size)
        placement = round_robin_placement(
            num_layers=self.num_layers, num_experts=self.num_experts, num_ranks=size, slots_per_rank=slots
        )
        # On the CPU the ranks share the host's cores: each takes its share of threads, or their
        # spinning OpenMP threads starve each other (restored by close()).
        self._threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, self._threads // size))
        self._rendezvous = Rendezvous.open(size)
        self.remotes: list[_RemoteRank] = []
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EPRankMessage)
        try:
            for rank in range(1, size):
                self.remotes.append(
                    self._start_rank(EPGroupSpec(port=self._rendezvous.port, rank=rank, size=size), placement)
                )
            group = join_group(
                rank=0, size=size, port=self._rendezvous.port, device=self.device, rendezvous=self._rendezvous
            )
            self.local = RankEngine(local, group, placement)
            for remote in self.remotes:
                remote.report = self._receive(remote)  # ready
        except BaseException:
            for remote in self.remotes:
                remote.process.kill()
            torch.set_num_threads(self._threads)
            raise
        # The model and settings are rank 0's engine's: every rank's is built from the same EngineArgs.
        self.info = local.info
        self.kv_store = local.kv_store
        self.requests: dict[str, InFlight] = {}
        self.placement = placement
        self._pending_placement: Placement | None = None
        self.load_window = LoadWindow()
        # Tokens routed to each logical expert per MoE layer since the start: what a resize places by.
        self.expert_totals = [[0] * self.num_experts for _ in range(self.num_layers)]
        self._load_collected_at = time.monotonic()
        self.resized_at = 0.0
        self.resize_reason = ""

    @property
    def ep_size(self) -> int:
        return 1 + len(self.remotes)

    @property
    def slots_per_rank(self) -> int:
        return len(self.placement[0][0])

    def add_request(self, request: EngineRequest) -> None:
        """LLMEngine.add_request's checks and errors; the request goes to the least loaded rank."""
        if request.prefill_only:
            raise InvalidRequestError("an expert-parallel worker serves whole requests (role mixed)")
        if not isinstance(request.kv, ComputePrompt):
            raise InvalidRequestError("an expert-parallel worker continues no other worker's requests (role mixed)")
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.local.engine.admission.max_tokens(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.prompt_logprobs,
            request.traffic_class,
            in_use=False,
        )
        check_cache_hints(request.cache_hints, len(request.prompt_token_ids))
        constraint = self._compile(request.request_id, request.constraint) if request.constraint is not None else None
        rank = 0 if constraint is not None else self._least_loaded()
        self._check_room(rank)
        self._submit(InFlight(request=request, rank=rank, constraint=constraint))

    def abort_request(self, request_id: str) -> RequestDelta | None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return None
        if entry.rank == 0:
            return self.local.engine.abort_request(request_id)
        remote = self.remotes[entry.rank - 1]
        unsent = [request for request in remote.commands if request.request_id == request_id]
        if unsent:
            remote.commands.remove(unsent[0])
        else:
            remote.aborts.append(request_id)
        return aborted(entry, has_tokenizer=self.info.tokenizer is not None)

    def has_unfinished(self) -> bool:
        """Whether a step has anything to do: a request in flight, or an abort still to deliver."""
        return (
            bool(self.requests)
            or self.local.engine.has_unfinished()
            or any(r.aborts or r.commands or r.report.has_unfinished for r in self.remotes)
        )

    def apply_layout(self, num_logical_experts: int, placement: object) -> None:
        """Check a placement ([layer][rank][slot]) against the model and the group in force
        (PlacementError saying why, and nothing changes); every rank puts it in force before the
        next step, so every forward runs under one placement on all ranks."""
        if num_logical_experts != self.num_experts:
            raise PlacementError(f"the model has {self.num_experts} experts per layer, not {num_logical_experts}")
        placement = check_placement(
            placement, num_layers=self.num_layers, num_experts=self.num_experts, num_ranks=self.ep_size
        )
        slots = {len(experts) for layer in placement for experts in layer}
        if slots != {self.slots_per_rank}:
            raise PlacementError(
                f"every rank has {self.slots_per_rank} expert slots; the placement has {sorted(slots)}"
            )
        self._pending_placement = placement

    def take_expert_load(self) -> list[list[int]]:
        """Tokens routed to each physical slot per MoE layer since the previous take (any thread)."""
        return self.load_window.take()

    def ep_group(self) -> EPGroupState:
        return EPGroupState(size=self.ep_size, resized_at=self.resized_at, resize_reason=self.resize_reason)

    def use_swa_state(self, source: object) -> None:
        raise ValueError("an expert-parallel engine keeps no SWA state: its hybrid hits replay")

    # An expert-parallel worker serves role mixed only: it neither hands KV to another worker nor
    # migrates requests when it drains, so it has none pinned for export.

    def export_kv(self, request_id: str) -> KVHandoff:
        raise InvalidRequestError("an expert-parallel engine exports no KV (it serves role mixed)")

    def release_transfer(self, request_id: str) -> bool:
        return False

    def suspend_for_migration(self, request_id: str) -> RequestDelta | None:
        return None

    def resume_suspended(self, request_id: str) -> bool:
        return False

    def step(self) -> list[RequestDelta]:
        """One lockstep step of every rank; a rank that died in it makes the survivors re-form."""
        placement, self._pending_placement = self._pending_placement, None
        collect = placement is not None or time.monotonic() - self._load_collected_at >= LOAD_INTERVAL_S
        stepping = self.local.engine.has_unfinished() or any(
            r.report.has_unfinished or r.commands for r in self.remotes
        )
        for remote in self.remotes:
            command = EPRankCommand(
                step=stepping, requests=remote.commands, aborts=remote.aborts, placement=placement, collect_load=collect
            )
            remote.commands, remote.aborts = [], []
            try:
                self._send(remote, command)
            except OSError:  # its pipe broke: it died, which receiving its report finds
                pass
        deltas: list[RequestDelta] = []
        load: list[list[int]] = []
        local_error: Exception | None = None
        try:
            if placement is not None:
                self.local.apply_placement(placement)
            if stepping:
                deltas = self.local.step()
            if collect:
                load = self.local.take_load()
        except Exception as error:  # a collective broke (a peer died?), or the engine did
            local_error = error
        reports, failed = self._gather()
        if placement is not None:
            self.placement = placement
        for report in reports:
            deltas += report_deltas(report, has_tokenizer=self.info.tokenizer is not None)
        deltas = self._track(deltas)
        if collect:
            self._load_collected_at = time.monotonic()
            # Counts from before a new placement went with its swap; these are all under the new one.
            per_rank = [load, *(r.expert_load for r in reports)]
            self.load_window.add(per_rank, restart=placement is not None)
            self._add_totals(per_rank)
        if failed or local_error is not None:
            dead = [rank for rank, r in enumerate(self.remotes, start=1) if not r.process.is_alive()]
            if not dead:
                raise RankFailedError("an EP step failed with every rank alive") from local_error
            self._resize(dead)
        return deltas

    def _add_totals(self, per_rank: list[list[list[int]]]) -> None:
        """Fold the ranks' per-slot counts into per-expert totals, through the placement in force."""
        for counts in per_rank:
            for layer, slot_counts in enumerate(counts):
                experts = [expert for rank in self.placement[layer] for expert in rank]
                totals = self.expert_totals[layer]
                for slot, count in enumerate(slot_counts):
                    totals[experts[slot]] += count

    def _gather(self) -> tuple[list[EPRankReport], bool]:
        """Every live rank's report of the step; and whether any rank failed it or died."""
        reports, failed = [], False
        for remote in self.remotes:
            try:
                remote.report = self._receive(remote)
            except RankFailedError:
                failed = True
                continue
            failed |= bool(remote.report.error)
            reports.append(remote.report)
        return reports, failed

    def stats(self) -> EngineStats:
        local = self.local.engine.stats()
        reports = [r.report for r in self.remotes]
        num_pages = local.num_pages + sum(r.num_pages for r in reports)
        num_free = local.num_free_pages + sum(r.num_free_pages for r in reports)
        return EngineStats(
            num_running=local.num_running + sum(r.num_running for r in reports),
            num_waiting=local.num_waiting + sum(r.num_waiting for r in reports),
            num_free_pages=num_free,
            num_pages=num_pages,
            kv_usage=1.0 - num_free / num_pages if num_pages else 0.0,
            num_computed_tokens=local.num_computed_tokens,
            num_prompt_tokens=local.num_prompt_tokens + sum(r.num_prompt_tokens for r in reports),
            num_cached_prompt_tokens=local.num_cached_prompt_tokens + sum(r.num_cached_prompt_tokens for r in reports),
            num_preemptions=local.num_preemptions + sum(r.num_preemptions for r in reports),
            store=local.store,
            cost_model_error=local.cost_model_error,
            # Rank 0's: the ranks step in lockstep, so its step times are the group's; its tokens are
            # its own share of each step.
            steps=local.steps,
        )

    def close(self) -> None:
        for remote in self.remotes:
            try:
                self._send(remote, EPRankCommand(step=False, stop=True))
            except (BrokenPipeError, OSError):
                pass
        for remote in self.remotes:
            remote.process.join(timeout=10)
            if remote.process.is_alive():
                remote.process.kill()
        self.local.group.destroy()
        self.local.engine.close()
        torch.set_num_threads(self._threads)

    # Requests.

    def _compiled_constraint(self, request_id: str, spec: OutputConstraintSpec) -> TokenConstraint:
        """Rank 0's engine's constraints are compiled here once, in add_request: a request resubmitted
        after a resize goes on with its constraint where it was."""
        return self.requests[request_id].constraint

    def _least_loaded(self) -> int:
        counts = [0] * self.ep_size
        for entry in self.requests.values():
            counts[entry.rank] += 1
        return counts.index(min(counts))

    def _check_room(self, rank: int) -> None:
        """A rank takes at most max_num_seqs running plus max_waiting waiting requests."""
        waiting = self.args.max_waiting
        if waiting is None:
            return
        held = sum(1 for entry in self.requests.values() if entry.rank == rank)
        if held >= self.args.max_num_seqs + waiting:
            raise EngineOverloadedError(f"rank {rank} of this EP worker holds {held} requests")

    def _submit(self, entry: InFlight) -> None:
        """Rank 0 takes its requests at once (and may refuse one: then nothing is recorded); the
        others' go with their next command."""
        request = entry.continued()
        # Recorded first: rank 0's engine takes the request's compiled constraint from its entry.
        self.requests[request.request_id] = entry
        if entry.rank == 0:
            try:
                self.local.engine.add_request(request)
            except Exception:
                del self.requests[request.request_id]
                raise
        else:
            self.remotes[entry.rank - 1].commands.append(request)

    def _track(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Record what each request streamed and drop outputs of requests aborted meanwhile."""
        kept = []
        for delta in deltas:
            entry = self.requests.get(delta.request_id)
            if entry is None:
                continue
            entry.record(delta)
            if delta.finished:
                del self.requests[delta.request_id]
            kept.append(delta)
        return kept

    # Ranks.

    def _start_rank(self, spec: EPGroupSpec, placement: Placement) -> _RemoteRank:
        ours, theirs = CONTEXT.Pipe()
        process = CONTEXT.Process(
            target=run_rank_process,
            args=(self.args, spec, placement, theirs),
            name=f"ep-rank-{spec.rank}",
            daemon=True,
        )
        process.start()
        theirs.close()
        return _RemoteRank(process=process, pipe=ours, report=EPRankReport(rank=spec.rank))

    def _send(self, remote: _RemoteRank, command: EPRankCommand) -> None:
        remote.pipe.send_bytes(self.encoder.encode(command))

    def _receive(self, remote: _RemoteRank) -> EPRankReport:
        """The rank's next report; RankFailedError when it died first."""
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while time.monotonic() < deadline:
            ready = wait([remote.pipe, remote.process.sentinel], timeout=deadline - time.monotonic())
            if remote.pipe in ready:
                try:
                    return self.decoder.decode(remote.pipe.recv_bytes())
                except (EOFError, OSError):
                    break
            if remote.process.sentinel in ready:
                break
        raise RankFailedError(f"EP rank process {remote.process.name} is gone (exit code {remote.process.exitcode})")

    def _resize(self, dead: list[int]) -> None:
        """Re-form the group from the survivors, put a placement covering every expert on them in
        force, and resubmit every request in flight (each survivor's own too: a step that broke
        part-way left them half-computed) from its prompt and what it streamed."""
        for rank in dead:
            self.remotes[rank - 1].process.join(timeout=1)
        old_ranks = [0] + [rank for rank in range(1, self.ep_size) if rank not in dead]
        new_rank = {old: new for new, old in enumerate(old_ranks)}
        survivors = [self.remotes[rank - 1] for rank in old_ranks[1:]]
        size = len(old_ranks)
        slots = max(self.slots_per_rank, slots_for(self.num_experts, size))
        # The EPLB over the load seen so far (one token more per expert: one never routed to still
        # needs its slot), so the survivors start balanced; every expert gets at least one slot.
        loads = [[count + 1 for count in layer] for layer in self.expert_totals]
        placement = place_experts(loads, gpus=size, slots=size * slots).tolist()
        reason = f"EP ranks {dead} died; the group re-formed with {size} ranks"
        log.warning("%s; resubmitting %d requests", reason, len(self.requests))
        self.local.group.destroy()
        self._rendezvous = Rendezvous.open(size)
        for old, remote in zip(old_ranks[1:], survivors, strict=True):
            spec = EPGroupSpec(port=self._rendezvous.port, rank=new_rank[old], size=size)
            aborts = [request_id for request_id, entry in self.requests.items() if entry.rank == old]
            self._send(remote, EPRankCommand(step=False, regroup=spec, placement=placement, aborts=aborts))
        group = join_group(
            rank=0, size=size, port=self._rendezvous.port, device=self.device, rendezvous=self._rendezvous
        )
        self.local.apply_placement(placement, group)
        for remote in survivors:
            remote.report = self._receive(remote)  # its abort outputs are ours, not the clients'
            remote.commands, remote.aborts = [], []
        self.remotes = survivors
        self.placement = placement
        self.load_window.clear()
        entries = list(self.requests.values())
        self.requests = {}
        for entry in entries:
            if entry.rank == 0:
                self.local.engine.abort_request(entry.request.request_id)
            entry.rank = new_rank.get(entry.rank, -1)
        # The lost ranks' requests go to the least loaded survivors once the others have their place.
        for entry in sorted(entries, key=lambda e: e.rank < 0):
            if entry.rank < 0:
                entry.rank = self._least_loaded()
            self._submit(entry)
        self.resized_at = time.time()
        self.resize_reason = reason
