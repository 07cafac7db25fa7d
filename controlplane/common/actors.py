"""Who did something, as recorded on audit rows: a Django user, a tenant (API key), or the system (None)."""

from typing import Any

from django.db import models

SYSTEM_LABEL = "system"


def actor_user(actor: Any) -> models.Model | None:
    """The user row to link, if the actor is one (a TenantPrincipal or the system is not)."""
    return actor if isinstance(actor, models.Model) and actor.pk is not None else None


def actor_label(actor: Any) -> str:
    """A name that survives the user's deletion: username, "tenant:<name>" or "system"."""
    return SYSTEM_LABEL if actor is None else actor.username
