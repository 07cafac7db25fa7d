"""What the engine needs from an output constraint (a JSON schema, a regex, a tool-call grammar).

The engine does not know grammars: `recipe` compiles a request's constraint into an object with
these three methods, and the engine asks it for a token mask before each sampled token and tells
it which token was chosen. A constraint belongs to one request and is only used from the engine's
thread.
"""

from typing import Protocol

import torch


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
