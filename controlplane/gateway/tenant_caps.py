"""Per-tenant admission caps: a tenant's API calls in flight (from admission to the end of the
response), and the prompt tokens of its admitted requests that still wait for their first output
token (each of n choices counts its prompt). Past either cap a request gets a 429 with retry-after.

The in-flight cap is checked at admission, before any work for the body; the queued-token cap once the
prompt is tokenized. A request that finds none of its tenant's tokens queued is admitted whatever its
length, so the cap bounds a tenant's backlog and never refuses a lone long prompt. A tenant's own
fields set its caps; empty ones take the gateway's defaults (SLUICE_TENANT_MAX_*). With
SLUICE_FAIR_ADMISSION off nothing is refused.

The counts live in this process's memory, like the rate limits: exact for one gateway process; N
processes would each allow the full caps. A lock guards them: a hold may be released from a
preparation thread (TenantHold.release_after).
"""

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from django.conf import settings

from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant


@dataclass(slots=True)
class _Load:
    in_flight: int = 0
    queued_prompt_tokens: int = 0


class TenantLoads:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: dict[int, _Load] = {}

    def admit(self, tenant: Tenant) -> "TenantHold":
        """Counts one more call in flight for the tenant, or raises the 429; the hold also carries the
        tenant's place in the fair queues."""
        cap = _cap(tenant.max_requests_in_flight, settings.SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT)
        with self._lock:
            load = self._loads.setdefault(tenant.pk, _Load())
            if cap is not None and load.in_flight >= cap:
                raise _refusal(f"This API key's tenant has {load.in_flight} requests in flight, its limit")
            load.in_flight += 1
        queued_cap = _cap(tenant.max_queued_prompt_tokens, settings.SLUICE_TENANT_MAX_QUEUED_PROMPT_TOKENS)
        return TenantHold(self, tenant.pk, queued_cap, _fair_share_of(tenant))

    def load(self, tenant_id: int) -> tuple[int, int]:
        """(calls in flight, queued prompt tokens) of a tenant."""
        with self._lock:
            load = self._loads.get(tenant_id, _Load())
            return load.in_flight, load.queued_prompt_tokens

    def _queue(self, tenant_id: int, tokens: int, cap: int | None) -> None:
        with self._lock:
            load = self._loads[tenant_id]
            queued = load.queued_prompt_tokens
            if cap is not None and queued and queued + tokens > cap:
                raise _refusal(
                    f"This API key's tenant has {queued} prompt tokens waiting for their first output; "
                    f"{tokens} more would pass its limit of {cap}"
                )
            load.queued_prompt_tokens += tokens

    def _unqueue(self, tenant_id: int, tokens: int) -> None:
        with self._lock:
            self._loads[tenant_id].queued_prompt_tokens -= tokens

    def _release(self, tenant_id: int, queued_tokens: int) -> None:
        with self._lock:
            load = self._loads[tenant_id]
            load.in_flight -= 1
            load.queued_prompt_tokens -= queued_tokens
            if not load.in_flight:
                del self._loads[tenant_id]


@dataclass(frozen=True, slots=True)
class FairShare:
    """The tenant as the fair queues know it (the gateway's preparation queues, the engines' waiting
    queues): its id and its weight."""

    tenant: str
    weight: int


class TenantHold:
    """One admitted call's part of its tenant's load. Released once, however the call ends; a
    release while the call's preparation still runs (its client went away) waits for it, so that a
    client cannot leave CPU work behind that its tenant's cap no longer counts."""

    def __init__(self, loads: TenantLoads, tenant_id: int, queued_cap: int | None, fair_share: FairShare) -> None:
        self.fair_share = fair_share
        self._loads = loads
        self._tenant_id = tenant_id
        self._queued_cap = queued_cap
        self._queued_tokens = 0
        self._released = False
        self._pending: Future | None = None

    def queue_prompt(self, tokens: int) -> None:
        """The call's prompts wait for their first tokens: counted, or the 429."""
        self._loads._queue(self._tenant_id, tokens, self._queued_cap)
        self._queued_tokens += tokens

    def prompt_started(self, tokens: int) -> None:
        """One of the call's prompts got its first output token."""
        tokens = min(tokens, self._queued_tokens)
        self._loads._unqueue(self._tenant_id, tokens)
        self._queued_tokens -= tokens

    def release_after(self, work: Future) -> None:
        """Release only once `work` (the call's preparation, still running) has ended."""
        self._pending = work

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._pending is not None and not self._pending.done():
            self._pending.add_done_callback(lambda _: self._release_now())
        else:
            self._release_now()

    def _release_now(self) -> None:
        self._loads._release(self._tenant_id, self._queued_tokens)
        self._queued_tokens = 0


def _cap(own: int | None, default: int) -> int | None:
    if not settings.SLUICE_FAIR_ADMISSION:
        return None
    return own if own is not None else default


def _refusal(reason: str) -> GatewayError:
    retry_after = settings.SLUICE_TENANT_CAP_RETRY_AFTER_S
    return GatewayError("rate_limit", f"{reason}; retry after {retry_after} s.", retry_after=retry_after)


def _fair_share_of(tenant: Tenant) -> FairShare:
    """With fair admission off, every tenant is the same one."""
    if not settings.SLUICE_FAIR_ADMISSION:
        return FairShare("", 1)
    return FairShare(str(tenant.pk), tenant.fair_share_weight)


loads = TenantLoads()
