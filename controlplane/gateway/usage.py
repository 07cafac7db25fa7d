"""What each API call used, counted from the engine's outputs and recorded per tenant and day.

Recording is one database write (off the event loop), awaited as the generation ends, before its
response is complete: the tenant's next request sees it (in the row, and in the gateways' shared
quota counter when there is one: quota.py), so a daily quota is exact, and nothing is written after a
response is over. A request that ends early (client gone, engine error) is recorded
with what it did use.
"""

import logging
import time
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async

from controlplane.gateway.quota import count_quota_tokens
from controlplane.tenants.services import tenant_usage_record
from workers.protocol.messages import GenerateOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class UsageCount:
    """One API call's tokens; n choices share one prompt, so it is counted once. It also times the
    outputs for telemetry (time.monotonic() seconds)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None  # until the first output that carried tokens
    # Between consecutive outputs of one choice: per engine step, as vLLM measures it, so a step that
    # brings several (speculative) tokens counts once.
    inter_token_s: list[float] = field(default_factory=list)
    finish_reasons: dict[int, str] = field(default_factory=dict)  # by choice; a choice cut short has none
    # Per choice that finished: seconds from the start to its last output (vLLM's e2e latency).
    e2e_s: list[float] = field(default_factory=list)
    # Per choice that finished with more than one token: seconds per token after its first, (last
    # output - first output) / (tokens - 1), as vLLM's per-request TPOT.
    tpot_s: list[float] = field(default_factory=list)
    # Seconds the workers timed (RequestPhaseTimes): each worker a choice ran on sends its phases.
    queue_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    _first_output_at: dict[int, float] = field(default_factory=dict)
    _last_output_at: dict[int, float] = field(default_factory=dict)
    _choice_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, output: GenerateOutput, *, choice: int = 0) -> None:
        now = time.monotonic()
        if output.num_prompt_tokens:
            self.prompt_tokens = output.num_prompt_tokens
            self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        self.completion_tokens += len(output.token_ids)
        if output.token_ids:
            if self.ttft_s is None:
                self.ttft_s = now - self.started_at
            if choice in self._last_output_at:
                self.inter_token_s.append(now - self._last_output_at[choice])
            self._first_output_at.setdefault(choice, now)
            self._last_output_at[choice] = now
            self._choice_tokens[choice] = self._choice_tokens.get(choice, 0) + len(output.token_ids)
        times = output.phase_times
        if times is not None:
            phases = ((times.queue_s, self.queue_s), (times.prefill_s, self.prefill_s), (times.decode_s, self.decode_s))
            for seconds, into in phases:
                if seconds is not None:
                    into.append(seconds)
        if output.finish_reason is not None:
            self.finish_reasons[choice] = output.finish_reason
            self.e2e_s.append(now - self.started_at)
            tokens = self._choice_tokens.get(choice, 0)
            if tokens > 1:
                self.tpot_s.append((self._last_output_at[choice] - self._first_output_at[choice]) / (tokens - 1))


async def record_usage(tenant_id: int, usage: UsageCount) -> None:
    """Adds the call's tokens to the tenant's row of the day; a failure is logged, not raised: the
    client was served either way."""
    try:
        await sync_to_async(tenant_usage_record)(
            tenant_id=tenant_id,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
    except Exception:
        log.exception("recording usage of tenant %d failed", tenant_id)
        return
    await count_quota_tokens(tenant_id, usage.prompt_tokens + usage.completion_tokens)
