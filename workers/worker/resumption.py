"""A decode worker's side of failover: it checkpoints the decoding state of the requests it runs
(workers.worker.checkpoints) and continues a dead worker's request from that checkpoint and the KV
store (ResumeDecodeRequest).

The tokens to continue from are the client's (the gateway's `output_token_ids`): the checkpoint,
written at the last block boundary, must agree with them (same prompt, its tokens a prefix of
them, same model, params that differ at most by the seed it was given) and supplies the seed, so an
unseeded sampled stream continues with the draws it would have had. The engine fetches every full
block of those tokens the store holds and recomputes only the rest.
"""

import logging
from collections.abc import Callable

import msgspec

from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestDelta
from workers.engine.structured.constraint import ConstraintError
from workers.protocol.engine_request import ContinueFromTokens, EngineRequest
from workers.protocol.errors import EngineOverloadedError, InvalidRequestError
from workers.protocol.messages import (
    DecodingState,
    GenerateError,
    ResumeDecodeRequest,
    WorkerOutbound,
)
from workers.worker.checkpoints import CheckpointError, Checkpoints
from workers.worker.control import WorkerControl

log = logging.getLogger(__name__)


class Resumption:
    def __init__(
        self,
        *,
        worker_id: str,
        engine: LLMEngine,
        control: WorkerControl,
        owners: dict[str, bytes],
        send: Callable[[bytes, WorkerOutbound], None],
        checkpoints: Checkpoints | None,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.control = control
        self.owners = owners
        self.send = send
        self.checkpoints = checkpoints
        self.moved: list[str] = []  # requests migrated away, whose checkpoints stay until the worker stops

    def took_in(self, request_id: str) -> None:
        """A request arrived here (from prefill, or migrated): its first checkpoint, and its prompt's
        tail in the store, so that a resume recomputes only what it generates from here."""
        request = self.engine.requests.get(request_id)
        if self.checkpoints is not None and request is not None:
            self.checkpoints.save(request)
            self.engine.store_prompt_tail(request_id)

    def after_step(self, deltas: list[RequestDelta]) -> None:
        """Checkpoint the requests whose tokens filled a block; forget those that ended. A request
        resumed here stores its prompt's tail once it is computed again."""
        if self.checkpoints is None:
            return
        for delta in deltas:
            request = self.engine.requests.get(delta.request_id)
            if request is None:
                self.checkpoints.delete(delta.request_id)
            else:
                self.checkpoints.save_at_block_boundary(request)
                self.engine.store_prompt_tail(delta.request_id)

    def moved_away(self, request_id: str) -> None:
        """The request migrated to another decode worker. Its checkpoint here stays until this worker
        stops: should the new worker refuse it after the KV left, the request is resumed from it."""
        self.moved.append(request_id)

    def close(self) -> None:
        """The worker stops: the checkpoints of the requests that migrated away go."""
        if self.checkpoints is not None:
            for request_id in self.moved:
                self.checkpoints.delete(request_id)
        self.moved.clear()

    def on_resume_decode(self, peer: bytes, message: ResumeDecodeRequest) -> None:
        request = message.request
        request_id = request.request_id
        if self.checkpoints is None:
            message_text = f"worker {self.worker_id} has no KV store and keeps no checkpoints"
            self.send(peer, GenerateError(request_id, "checkpoint_invalid", message_text))
            return
        if not self.control.accepting:
            message_text = f"worker {self.worker_id} is {self.control.state} and takes no new requests"
            self.send(peer, GenerateError(request_id, "draining", message_text))
            return
        try:
            state = self.checkpoints.read(message.checkpoint_id)
            check_agrees(state, message, self.engine.kv_model_id)
        except CheckpointError as error:
            log.warning("cannot resume %s: %s", request_id, error)
            self.send(peer, GenerateError(request_id, "checkpoint_invalid", str(error)))
            return
        try:
            self.engine.add_request(
                EngineRequest(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    params=state.params,
                    kv=ContinueFromTokens(message.output_token_ids, num_cached_tokens=state.num_cached_tokens),
                    cache_namespace=request.cache_namespace,
                    constraint=request.constraint,
                    traffic_class=request.traffic_class,
                    tenant=request.tenant,
                    tenant_weight=request.tenant_weight,
                )
            )
        except (InvalidRequestError, ConstraintError) as error:
            self.send(peer, GenerateError(request_id, "invalid_request", str(error)))
            return
        except EngineOverloadedError as error:
            self.send(peer, GenerateError(request_id, "overloaded", str(error)))
            return
        self.owners[request_id] = peer
        self.checkpoints.delete(message.checkpoint_id)
        self.took_in(request_id)


def check_agrees(state: DecodingState, message: ResumeDecodeRequest, kv_model_id: str) -> None:
    """CheckpointError unless the checkpoint is of this request as the gateway knows it."""
    request, tokens = message.request, message.output_token_ids
    name = message.checkpoint_id
    if state.kv_model_id != kv_model_id:
        raise CheckpointError(
            f"checkpoint of {name!r} is of model {state.kv_model_id!r}; this worker runs {kv_model_id!r}"
        )
    if state.prompt_token_ids != request.prompt_token_ids:
        raise CheckpointError(f"checkpoint of {name!r} has another prompt")
    if tokens[: len(state.output_token_ids)] != state.output_token_ids:
        raise CheckpointError(f"checkpoint of {name!r} has output tokens the client was not sent")
    if msgspec.structs.replace(state.params, seed=request.params.seed) != request.params:
        raise CheckpointError(f"checkpoint of {name!r} has other sampling params")
