"""What the engine needs from an output constraint (a JSON schema, a regex, a tool-call grammar), and
how it keeps a constraint's failure to the request that has it.

The engine loop does not know grammars: `structured.grammar` compiles a request's constraint into
an object with these three methods, and the engine asks it for a token mask before each sampled
token and tells it which token was chosen. A constraint belongs to one request and is only used from the engine's
thread.

A constraint may fail while the request runs (its grammar hits a resource limit on the text the
model wrote): it raises ConstraintError, and the engine ends that request alone. Masks are computed
for a whole step's batch at once, where an exception would fail every request in it, so the engine
holds each constraint in an IsolatedConstraint, whose mask never raises.
"""

from typing import Protocol

import torch


class ConstraintError(Exception):
    """A request's output constraint failed on its output: its grammar hit a resource limit (lexer
    fuel, states, Earley items) or refused the token. The message is meant for the client."""


class TokenConstraint(Protocol):
    def allowed_tokens(self) -> torch.Tensor:
        """A bool [vocab_size] CPU tensor: True for the tokens that may come next.

        Never all False while `is_finished()` is False (a finished output lets the engine stop).
        """
        ...

    def advance(self, token_id: int) -> None:
        """Consume the token sampled under the last mask."""
        ...

    def is_finished(self) -> bool:
        """The output is complete: the engine stops the request with finish_reason "stop"."""
        ...


class IsolatedConstraint:
    """A request's constraint as the engine holds it: computing its mask never raises.

    A mask that raises, or is not a bool [vocab_size] tensor, is replaced by one that allows every
    token, and the failure is raised again from the next advance(), which the engine calls for this
    request alone (the token sampled under that mask is never delivered)."""

    def __init__(self, constraint: TokenConstraint, vocab_size: int) -> None:
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.failure: Exception | None = None

    def allowed_tokens(self) -> torch.Tensor:
        if self.failure is None:
            try:
                allowed = self.constraint.allowed_tokens()
                if allowed.dtype != torch.bool or tuple(allowed.shape) != (self.vocab_size,):
                    raise ValueError(
                        f"an allowed-token mask must be bool [{self.vocab_size}], got "
                        f"{allowed.dtype} {tuple(allowed.shape)}"
                    )
                return allowed
            except Exception as error:
                self.failure = error
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def advance(self, token_id: int) -> None:
        if self.failure is not None:
            raise self.failure
        self.constraint.advance(token_id)

    def is_finished(self) -> bool:
        return self.failure is None and self.constraint.is_finished()
