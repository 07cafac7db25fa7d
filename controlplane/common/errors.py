"""Domain errors raised by services; the API maps DomainValidationError to 400 and ConflictError to 409."""

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError


class DomainValidationError(Exception):
    """Input a service refuses: per-field messages in `fields`, anything else in `message`."""

    def __init__(self, message: str = "", *, fields: dict[str, list[str]] | None = None) -> None:
        self.fields: dict[str, list[str]] = fields or {}
        self.message = message or "; ".join(f"{name}: {' '.join(msgs)}" for name, msgs in self.fields.items())
        super().__init__(self.message)

    @classmethod
    def from_django(cls, error: ValidationError) -> "DomainValidationError":
        """From a model's full_clean(): Django's non-field key "__all__" becomes the message."""
        messages = error.message_dict if hasattr(error, "error_dict") else {NON_FIELD_ERRORS: error.messages}
        non_field = messages.get(NON_FIELD_ERRORS, [])
        fields = {name: list(msgs) for name, msgs in messages.items() if name != NON_FIELD_ERRORS}
        return cls(" ".join(non_field), fields=fields)


class ConflictError(Exception):
    """A valid request the current state does not allow (a refused state transition, a rate limit hit)."""
