"""Errors the engine raises to its callers.

Each names the offending input so that a gateway can turn it into a protocol error body without
guessing. None of them leaves engine state half-changed: they are raised before a request is
admitted or a model is built.
"""


class EngineError(Exception):
    """Base class of every error the engine reports to callers."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) the engine refuses to admit."""


class InvalidConstraintError(InvalidRequestError):
    """A request's output constraint that does not compile (or an engine without a tokenizer to
    compile it with); a gateway reports it as "invalid_constraint", not "invalid_request"."""


class EngineOverloadedError(EngineError):
    """The engine's waiting queue is full (EngineArgs.max_waiting); the request may be retried."""


class UnknownModelError(EngineError, LookupError):
    """A model name that resolves to neither a packaged model nor a local directory."""


class ModelLoadError(EngineError):
    """Weights, config or tokenizer files that are missing, truncated or corrupt."""
