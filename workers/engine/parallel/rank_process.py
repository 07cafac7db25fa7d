"""The process of an EP rank other than 0: builds its engine, joins the group, then serves rank 0's
commands (workers.protocol.messages.EPRankCommand) over its pipe until told to stop or the pipe closes.

A command whose step fails (a collective broke: another rank died) is answered with the error; the
rank then waits for a command that re-forms the group. Its requests are rank 0's to resubmit.
"""

import dataclasses
import logging
from multiprocessing.connection import Connection

import msgspec
import torch

from workers.args import EngineArgs
from workers.engine.builder import build_rank_engine
from workers.engine.outputs import RequestDelta
from workers.engine.parallel.groups import join_group
from workers.engine.parallel.placement import Placement
from workers.engine.parallel.rank import RankEngine
from workers.process_title import set_process_title
from workers.protocol.engine_request import EngineRequest
from workers.protocol.errors import EngineOverloadedError, InvalidRequestError
from workers.protocol.messages import (
    EPGroupSpec,
    EPRankCommand,
    EPRankMessage,
    EPRankReport,
    EPRequestFailure,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
)

log = logging.getLogger(__name__)


PROCESS_TITLE = "sluice-ep-rank"  # /proc/self/comm keeps 15 bytes


def run_rank_process(args: EngineArgs, spec: EPGroupSpec, placement: Placement, pipe: Connection) -> None:
    """Serve rank 0 until it says stop or goes (its end of the pipe closes)."""
    set_process_title(PROCESS_TITLE)
    # The ranks share the host's cores with rank 0 (on the CPU, their device too).
    torch.set_num_threads(max(1, torch.get_num_threads() // spec.size))
    args = dataclasses.replace(args, device=rank_device(args.device, spec.rank))
    engine = build_rank_engine(args)
    group = join_group(rank=spec.rank, size=spec.size, port=spec.port, device=torch.device(args.device))
    rank = RankEngine(engine, group, placement)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EPRankMessage)
    pipe.send_bytes(encoder.encode(report(rank, [], [])))
    try:
        while True:
            try:
                command = decoder.decode(pipe.recv_bytes())
            except EOFError:
                return  # rank 0 is gone
            if command.stop:
                return
            pipe.send_bytes(encoder.encode(serve_command(rank, command)))
    finally:
        rank.group.destroy()


def rank_device(device: str, rank: int) -> str:
    """Rank r of an engine on CUDA runs on GPU r (rank 0 on the engine's own device); on the CPU
    every rank shares the host."""
    if torch.device(device).type != "cuda" or rank == 0:
        return device
    return f"cuda:{rank}"


def serve_command(rank: RankEngine, command: EPRankCommand) -> EPRankReport:
    refused: list[GenerateError] = []
    try:
        if command.regroup is not None:
            rank.group.destroy()
            spec = command.regroup
            group = join_group(rank=spec.rank, size=spec.size, port=spec.port, device=rank.group.device)
            rank.apply_placement(command.placement, group)
        elif command.placement is not None:
            rank.apply_placement(command.placement)
        deltas = [rank.engine.abort_request(request_id) for request_id in command.aborts]
        for request in command.requests:
            if error := admit(rank, request):
                refused.append(error)
        if command.step:
            deltas += rank.step()
    except Exception as error:
        log.exception("EP rank %d: the command failed", rank.group.rank)
        return EPRankReport(rank=rank.group.rank, error=f"{type(error).__name__}: {error}")
    load = rank.take_load() if command.collect_load else []
    return report(rank, [d for d in deltas if d is not None], refused, load)


def admit(rank: RankEngine, request: GenerateRequest) -> GenerateError | None:
    try:
        rank.engine.add_request(
            EngineRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=request.params,
                cache_namespace=request.cache_namespace,
                prompt_logprobs=request.prompt_logprobs,
                traffic_class=request.traffic_class,
                tenant=request.tenant,
                tenant_weight=request.tenant_weight,
                cache_hints=request.cache_hints,
            )
        )
    except InvalidRequestError as error:
        return GenerateError(request.request_id, "invalid_request", str(error))
    except EngineOverloadedError as error:
        return GenerateError(request.request_id, "overloaded", str(error))
    return None


def report(
    rank: RankEngine, deltas: list[RequestDelta], refused: list[GenerateError], load: list[list[int]] | None = None
) -> EPRankReport:
    stats = rank.engine.stats()
    return EPRankReport(
        rank=rank.group.rank,
        outputs=[output_of(delta) for delta in deltas],
        failures=[
            EPRequestFailure(delta.request_id, delta.failure.kind, delta.failure.message)
            for delta in deltas
            if delta.failure is not None
        ],
        refused=refused,
        has_unfinished=rank.engine.has_unfinished(),
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_pages=stats.num_free_pages,
        num_pages=stats.num_pages,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
        num_preemptions=stats.num_preemptions,
        expert_load=load or [],
    )


def output_of(delta: RequestDelta) -> GenerateOutput:
    return GenerateOutput(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        text=delta.text or "",
        logprobs=delta.logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        prompt_logprobs=delta.prompt_logprobs,
        num_stored_tokens=delta.num_stored_tokens,
        stored_tokens_by_hint=delta.stored_tokens_by_hint,
        phase_times=delta.phase_times,
    )
