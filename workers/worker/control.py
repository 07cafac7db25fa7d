"""A worker's answers to control commands: its drain state machine, the versions of the TTL policy and
expert layout it runs, and a memory of recent answers so that a retried command is not acted on twice.

States: ready → draining (requests in flight) → drained (none left) → ready again on Resume;
stopping after a Shutdown. Only a ready worker takes new requests. This class holds no sockets: the
worker calls `handle` for each command and `check_drained` after requests finish.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from workers.engine.parallel.placement import Placement, PlacementError
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.ttl import TTLPolicy
from workers.protocol.messages import (
    DRAINED,
    DRAINING,
    READY,
    STOPPING,
    ApplyEPLayoutRequest,
    ControlAck,
    ControlRequest,
    DrainRequest,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
)

log = logging.getLogger(__name__)

# Enough to cover any sender's retries of one command, bounded so a long-lived worker does not grow.
REMEMBERED_ANSWERS = 1024


class WorkerControl:
    def __init__(
        self,
        worker_id: str,
        *,
        ep_size: Callable[[], int],
        collector: GarbageCollector | None,
        num_in_flight: Callable[[], int],
        apply_placement: Callable[[int, Placement], None],
        remembered_answers: int = REMEMBERED_ANSWERS,
    ) -> None:
        """`ep_size()`: the ranks the engine runs now (fewer after a rank died and the rest re-formed).
        `apply_placement(num_logical_experts, placement)` puts an expert placement in force (the
        engine's apply_layout), raising PlacementError for one it cannot take; an engine without
        expert parallelism has no experts to move, and the worker records a valid layout's version."""
        self.worker_id = worker_id
        self.state = READY
        # time.monotonic() when a drain's grace period ends and its requests move (workers.worker.
        # migration); None: a drain waits for them to finish.
        self.migrate_at: float | None = None
        self.ttl_policy_version = 0
        self.ep_layout_version = 0
        self._ep_size = ep_size
        self._collector = collector
        self._num_in_flight = num_in_flight
        self._apply_placement = apply_placement
        self._answers: OrderedDict[str, ControlAck] = OrderedDict()
        self._remembered_answers = remembered_answers
        # Each action returns "" when done, or why it was refused (and then changes nothing).
        self._actions: dict[type, Callable[..., str]] = {
            DrainRequest: self._drain,
            ResumeRequest: self._resume,
            ShutdownRequest: self._shut_down,
            SetTTLPolicyRequest: self._set_ttl_policy,
            ApplyEPLayoutRequest: self._apply_ep_layout,
            StatusRequest: lambda request: "",
        }

    @property
    def accepting(self) -> bool:
        return self.state == READY

    def handle(self, request: ControlRequest) -> ControlAck:
        """Act on `request` unless its command id was seen before; either way, the answer to send."""
        answer = self._answers.get(request.command_id)
        if answer is not None:
            return answer
        refusal = self._actions[type(request)](request)
        if refusal:
            log.warning("worker %s refused %s: %s", self.worker_id, type(request).__name__, refusal)
        answer = self.ack(request.command_id, ok=not refusal, message=refusal)
        # A status is an observation, not an action: a repeated one should see the state of now.
        if not isinstance(request, StatusRequest):
            self._answers[request.command_id] = answer
            if len(self._answers) > self._remembered_answers:
                self._answers.popitem(last=False)
        return answer

    def ack(self, command_id: str, *, ok: bool, message: str = "") -> ControlAck:
        return ControlAck(
            command_id=command_id,
            worker_id=self.worker_id,
            ok=ok,
            state=self.state,
            message=message,
            ttl_policy_version=self.ttl_policy_version,
            ep_layout_version=self.ep_layout_version,
            num_in_flight=self._num_in_flight(),
        )

    def forget_ep_layout(self) -> None:
        """The EP group re-formed after a rank died and runs a placement of its own: no control-plane
        layout is in force until the next one is applied (version 0 in acks and heartbeats)."""
        log.warning("worker %s: EP layout version %d is no longer in force", self.worker_id, self.ep_layout_version)
        self.ep_layout_version = 0

    def check_drained(self) -> None:
        """Call when requests finish: a draining worker with none left is drained."""
        if self.state == DRAINING and self._num_in_flight() == 0:
            self.state = DRAINED
            log.info("worker %s drained", self.worker_id)

    def _drain(self, request: DrainRequest) -> str:
        if self.state == READY:
            self.state = DRAINING
            if request.grace_s is not None:
                self.migrate_at = time.monotonic() + request.grace_s
            self.check_drained()
        return "" if self.state != STOPPING else "the worker is shutting down"

    def _resume(self, request: ResumeRequest) -> str:
        if self.state == STOPPING:
            return "the worker is shutting down"
        self.state = READY
        self.migrate_at = None
        return ""

    def _shut_down(self, request: ShutdownRequest) -> str:
        self.state = STOPPING
        return ""

    def _set_ttl_policy(self, request: SetTTLPolicyRequest) -> str:
        if request.version < self.ttl_policy_version:
            return f"TTL policy version {request.version} is older than the active version {self.ttl_policy_version}"
        try:
            policy = TTLPolicy.from_dict(request.policy)
        except ValueError as error:
            return f"invalid TTL policy: {error}"
        # A worker without a GC records the version anyway: the control plane tracks what each
        # worker has acknowledged, and the store's GC runs in another process then.
        if self._collector is not None:
            self._collector.set_ttl_policy(policy)
        self.ttl_policy_version = request.version
        return ""

    def _apply_ep_layout(self, request: ApplyEPLayoutRequest) -> str:
        if request.version < self.ep_layout_version:
            return f"EP layout version {request.version} is older than the active version {self.ep_layout_version}"
        refusal = ep_layout_error(request, self._ep_size())
        if refusal:
            return refusal
        try:
            self._apply_placement(request.num_logical_experts, request.placement)
        except PlacementError as error:
            return f"invalid EP layout: {error}"
        self.ep_layout_version = request.version
        return ""


def ep_layout_error(request: ApplyEPLayoutRequest, ep_size: int) -> str:
    """Why `request` is not a valid layout for `ep_size` ranks, or "" when it is: every layer has
    ep_size ranks of one slot count (the same in every layer) and gives every expert a slot."""
    experts = request.num_logical_experts
    if experts < 1:
        return f"num_logical_experts must be positive, got {experts}"
    if not request.placement:
        return "the placement has no layers"
    slots = len(request.placement[0][0]) if request.placement[0] else 0
    for layer, ranks in enumerate(request.placement):
        if len(ranks) != ep_size:
            return f"layer {layer} of the placement has {len(ranks)} ranks; this worker has ep_size {ep_size}"
        uneven = [rank for rank, held in enumerate(ranks) if len(held) != slots]
        if uneven or not slots:
            return f"layer {layer}: every rank must hold the same number of slots ({slots}, as rank 0 of layer 0)"
        placed = [expert for held in ranks for expert in held]
        outside = sorted({expert for expert in placed if not 0 <= expert < experts})
        if outside:
            return f"layer {layer}: expert ids {outside} are outside 0..{experts - 1}"
        missing = sorted(set(range(experts)) - set(placed))
        if missing:
            return f"layer {layer}: experts {missing} have no slot on any rank"
    return ""
