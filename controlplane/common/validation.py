from django.core.exceptions import ValidationError
from django.db import models

from controlplane.common.errors import DomainValidationError


def full_clean_or_raise(instance: models.Model, *, exclude: list[str] | None = None) -> None:
    """Model validation (fields, clean(), unique and check constraints) as a DomainValidationError."""
    try:
        instance.full_clean(exclude=exclude)
    except ValidationError as error:
        raise DomainValidationError.from_django(error) from error
