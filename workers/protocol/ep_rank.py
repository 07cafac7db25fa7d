"""Messages between the ranks of an expert-parallel engine (workers.engine.parallel). Rank 0 of an EP
worker is the worker process; it drives each other rank over a pipe of its own: one EPRankCommand per
lockstep step, answered by one EPRankReport after that step."""

import msgspec

from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import GenerateError, GenerateOutput


class EPGroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a (re-formed) group meets: rank 0's TCP store on localhost, and this rank's place in it."""

    port: int
    rank: int
    size: int


class EPRankCommand(msgspec.Struct, tag="ep.command", frozen=True, forbid_unknown_fields=True):
    step: bool  # run one lockstep step (an empty pass when this rank has nothing to run)
    # Before the step: requests to admit (rank 0 checked them), requests to abort.
    requests: list[EngineRequest] = []
    aborts: list[str] = []
    # Before the step: join a re-formed group, then put `placement` ([layer][rank][slot]) in force.
    regroup: EPGroupSpec | None = None
    placement: list[list[list[int]]] | None = None
    # After the step: report (and restart) the expert load counters.
    collect_load: bool = False
    stop: bool = False  # leave the group and exit


class EPRequestFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request that ended with finish_reason "error" on a rank (workers.engine.outputs.RequestFailure)."""

    request_id: str
    kind: str
    message: str


class EPRankReport(msgspec.Struct, tag="ep.report", frozen=True, forbid_unknown_fields=True):
    rank: int
    outputs: list[GenerateOutput] = []
    failures: list[EPRequestFailure] = []
    # Requests that could not be admitted (rank 0's checks passed, this rank's capacity did not).
    refused: list[GenerateError] = []
    has_unfinished: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_pages: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    expert_load: list[list[int]] = []  # with collect_load: this rank's counts per layer and physical slot
    # Non-empty: the command failed (a collective broke: a peer died); the rank waits for a regroup.
    error: str = ""


EPRankMessage = EPRankCommand | EPRankReport
