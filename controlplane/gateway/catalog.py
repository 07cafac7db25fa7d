"""The models this gateway serves (settings.SLUICE_MODELS), resolved once per process."""

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from django.conf import settings

from controlplane.gateway.errors import GatewayError
from recipe.api import ServedModel
from workers.engine.weights import resolve_model


@dataclass(frozen=True, slots=True)
class Catalog:
    models: Mapping[str, ServedModel]
    created: int  # unix time the models were loaded, reported as each model's "created"


_lock = threading.Lock()
_catalog: Catalog | None = None


def load_catalog() -> Catalog:
    """Blocking: the first call may convert weights and reads every tokenizer."""
    global _catalog
    with _lock:
        if _catalog is None:
            models = {}
            for name in settings.SLUICE_MODELS:
                files = resolve_model(name, progress=False)
                models[files.name] = ServedModel.from_model_files(files, _context_window(files.config))
            _catalog = Catalog(models=models, created=int(time.time()))
    return _catalog


def _context_window(config: dict) -> int:
    """The engine's default context window is the model's own (its text model's, for a
    vision-language model); the workers enforce it too."""
    return (config.get("text_config") or config)["max_position_embeddings"]


async def served_catalog() -> Catalog:
    return _catalog or await asyncio.to_thread(load_catalog)


def require_model(body: dict, catalog: Catalog) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError("invalid_request", "`model` is required and must be a string.", param="model")
    if model not in catalog.models:
        raise GatewayError(
            "not_found",
            f"The model `{model}` does not exist; this server has: {', '.join(catalog.models)}.",
            param="model",
        )
