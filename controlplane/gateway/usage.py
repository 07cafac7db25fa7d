"""What each API call used, counted from the engine's outputs and recorded per tenant and day.

Recording is a database write that must not hold up the response: it runs after the generation
ends, off the event loop, and the tasks are kept referenced until done so none is collected early.
A request that ends early (client gone, engine error) is recorded with what it did use.
"""

import asyncio
import logging
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from controlplane.tenants.services import tenant_usage_record
from workers.protocol import GenerateOutput

log = logging.getLogger(__name__)

_pending: set[asyncio.Task] = set()


@dataclass(slots=True)
class UsageCount:
    """One API call's tokens; n choices share one prompt, so it is counted once."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, output: GenerateOutput) -> None:
        if output.num_prompt_tokens:
            self.prompt_tokens = output.num_prompt_tokens
            self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        self.completion_tokens += len(output.token_ids)


def record_usage_later(tenant_id: int, usage: UsageCount) -> None:
    task = asyncio.get_running_loop().create_task(_record(tenant_id, usage))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _record(tenant_id: int, usage: UsageCount) -> None:
    try:
        await sync_to_async(tenant_usage_record)(
            tenant_id=tenant_id,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
    except Exception:
        log.exception("recording usage of tenant %d failed", tenant_id)


async def wait_for_recordings() -> None:
    """For shutdown and tests: the recordings started so far, finished."""
    if _pending:
        await asyncio.gather(*list(_pending), return_exceptions=True)
