"""What the engine tests hand an engine the way a worker would: a request with a hand-written
constraint (the engine compiles a placeholder spec to it), and a handoff (its KV into the engine's
handoff connector, then the request that continues it)."""

import msgspec

from workers.engine.connectors.handoff import continuing
from workers.engine.engine import LLMEngine
from workers.engine.kv_handoff import KVHandoff
from workers.engine.structured.constraint import TokenConstraint
from workers.protocol.engine_request import EngineRequest
from workers.protocol.messages import OutputConstraintSpec

HAND_WRITTEN = OutputConstraintSpec(kind="hand-written", schema="")


def add_constrained(engine: LLMEngine, request: EngineRequest, constraint: TokenConstraint | None) -> None:
    engine.compile_constraint = lambda request_id, spec: constraint
    engine.add_request(msgspec.structs.replace(request, constraint=HAND_WRITTEN if constraint is not None else None))


def hand_over(engine: LLMEngine, handoff: KVHandoff, constraint: TokenConstraint | None = None) -> None:
    engine.disaggregation.receive(handoff)
    add_constrained(engine, continuing(handoff), constraint)
