"""What the engine needs from an output constraint (a JSON schema, a regex, a tool-call grammar), and
how it keeps a constraint's failure to the request that has it.

The engine loop does not know grammars: `structured.grammar` compiles a request's constraint into
an object with these methods, and the engine asks it for a token mask before each sampled token and
tells it which token was chosen; when it speculates, it also asks how much of a draft the constraint
allows and the masks along it. A constraint belongs to one request and is only used from the engine's
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

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the constraint allows in turn from here (a speculative draft is cut
        there); the state is unchanged."""
        ...

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The masks before each of `token_ids` (a valid prefix) and after the last, as allowed_tokens
        would give them were each consumed in turn: what a speculative verify step samples its rows
        under. The state is left as it was."""
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
                self._check(allowed)
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

    def valid_prefix(self, token_ids: list[int]) -> int:
        """0 (no draft) once the constraint failed."""
        if self.failure is None:
            try:
                return self.constraint.valid_prefix(token_ids)
            except Exception as error:
                self.failure = error
        return 0

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        """Masks that allow every token in place of any that fails, as allowed_tokens does."""
        if self.failure is None:
            try:
                masks = self.constraint.masks_along(token_ids)
                if len(masks) != len(token_ids) + 1:
                    raise ValueError(f"{len(token_ids)} tokens need {len(token_ids) + 1} masks, got {len(masks)}")
                for mask in masks:
                    self._check(mask)
                return masks
            except Exception as error:
                self.failure = error
        return [torch.ones(self.vocab_size, dtype=torch.bool) for _ in range(len(token_ids) + 1)]

    def _check(self, allowed: torch.Tensor) -> None:
        if allowed.dtype != torch.bool or tuple(allowed.shape) != (self.vocab_size,):
            raise ValueError(
                f"an allowed-token mask must be bool [{self.vocab_size}], got {allowed.dtype} {tuple(allowed.shape)}"
            )
