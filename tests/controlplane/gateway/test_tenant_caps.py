"""Per-tenant admission caps through the real ASGI application (fake engine): requests in flight and
queued prompt tokens, 429 with retry-after in each protocol's shape, and what the engine is told of
the tenant."""

import asyncio

import httpx
import pytest
from asgiref.sync import async_to_sync

from controlplane.asgi import application
from controlplane.gateway.tenant_caps import loads
from controlplane.tenants.models import Tenant
from tests.controlplane.gateway.helpers import PATHS, assert_error, key_headers, valid_body
from workers.protocol.messages import GenerateOutput

RATE_LIMIT_TYPES = {"chat.completions": "rate_limit_exceeded", "messages": "rate_limit_error"}


class Gate:
    """A fake engine script whose requests answer once the test opens the gate: the first output
    (which ends the prompt's wait) at `first`, the last at `last`."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.last = asyncio.Event()

    async def script(self, request):
        await self.first.wait()
        yield GenerateOutput(request_id=request.request_id, token_ids=[28], text="A")
        await self.last.wait()
        yield GenerateOutput(request_id=request.request_id, token_ids=[29], text="B", finish_reason="stop")

    def open(self) -> None:
        self.first.set()
        self.last.set()


async def _until(condition) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


def run(scenario):
    """Runs `scenario(client)` on one event loop, with an httpx client of the ASGI app (the
    database stays on this thread, in the test's transaction)."""

    async def main():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=20) as client:
            return await scenario(client)

    return async_to_sync(main)()


def post(client: httpx.AsyncClient, protocol: str, key: str, **fields):
    return client.post(PATHS[protocol], json=valid_body(protocol, **fields), headers=key_headers(key, "x-api-key"))


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_past_its_requests_in_flight_a_tenant_gets_429_and_another_tenant_is_served(
    api, make_api_key, make_tenant, fake_engine, settings, protocol
):
    # given: a tenant that may have two calls in flight, both held open by the engine
    settings.SLUICE_TENANT_CAP_RETRY_AFTER_S = 3
    gate = Gate()
    engine = fake_engine(gate.script)
    acme_key = make_api_key("acme", max_requests_in_flight=2)
    other_key = make_api_key("globex")

    async def scenario(client):
        held = [asyncio.create_task(post(client, protocol, acme_key)) for _ in range(2)]
        await _until(lambda: len(engine.requests) == 2)
        refused = await post(client, protocol, acme_key)
        other = asyncio.create_task(post(client, protocol, other_key))
        await _until(lambda: len(engine.requests) == 3)
        gate.open()
        finished = await asyncio.gather(*held, other)
        after = await post(client, protocol, acme_key)
        return refused, finished, after

    # when
    refused, finished, after = run(scenario)

    # then
    error = assert_error(refused, protocol, 429, RATE_LIMIT_TYPES[protocol])
    assert "2 requests in flight" in error["message"]
    assert refused.headers["retry-after"] == "3"
    assert [response.status_code for response in finished] == [200, 200, 200]
    assert after.status_code == 200  # the two that finished gave their places back
    assert loads.load(make_tenant("acme").pk) == (0, 0)


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_past_its_queued_prompt_tokens_a_tenant_gets_429_until_the_queue_moves(
    api, make_api_key, make_tenant, fake_engine, protocol
):
    # given: a cap that one prompt fits under and two do not
    gate = Gate()
    engine = fake_engine(gate.script)
    key = make_api_key("acme")
    tenant = make_tenant("acme")

    async def scenario(client):
        first = asyncio.create_task(post(client, protocol, key, stream=True))
        await _until(lambda: len(engine.requests) == 1)
        prompt_tokens = len(engine.requests[0].prompt_token_ids)
        await Tenant.objects.filter(pk=tenant.pk).aupdate(max_queued_prompt_tokens=prompt_tokens + 1)
        refused = await post(client, protocol, key)
        queued_while_refused = loads.load(tenant.pk)
        gate.first.set()  # the first request's prompt got its first token: it no longer waits
        await _until(lambda: loads.load(tenant.pk)[1] == 0)
        admitted = asyncio.create_task(post(client, protocol, key))
        await _until(lambda: len(engine.requests) == 2)
        gate.last.set()
        return refused, queued_while_refused, prompt_tokens, await first, await admitted

    # when
    refused, queued_while_refused, prompt_tokens, first, admitted = run(scenario)

    # then
    error = assert_error(refused, protocol, 429, RATE_LIMIT_TYPES[protocol])
    assert f"{prompt_tokens} prompt tokens waiting" in error["message"]
    assert refused.headers["retry-after"] == "1"
    assert queued_while_refused == (1, prompt_tokens)  # the refused call took nothing
    assert (first.status_code, admitted.status_code) == (200, 200)


def test_a_lone_prompt_longer_than_the_cap_is_admitted(api, make_api_key, fake_engine):
    gate = Gate()
    gate.open()
    fake_engine(gate.script)
    key = make_api_key("acme", max_queued_prompt_tokens=1)

    response = api.post("chat.completions", valid_body("chat.completions"), headers=key_headers(key))

    assert response.status_code == 200, response.text


def test_calls_that_fail_give_their_place_back(api, make_api_key, make_tenant, fake_engine):
    gate = Gate()
    gate.open()
    fake_engine(gate.script)
    key = make_api_key("acme", max_requests_in_flight=1)

    failed = [api.post("chat.completions", {"model": "smollm2-135m-instruct"}, headers=key_headers(key))]
    failed.append(api.request("POST", PATHS["chat.completions"], content=b"{", headers=key_headers(key)))
    failed.append(api.post("messages.count_tokens", {"model": "nope", "messages": []}, headers=key_headers(key)))
    served = api.post("chat.completions", valid_body("chat.completions"), headers=key_headers(key))

    assert [response.status_code for response in failed] == [400, 400, 404]
    assert served.status_code == 200, served.text
    assert loads.load(make_tenant("acme").pk) == (0, 0)


def test_the_engine_is_told_the_tenant_and_its_weight(api, make_api_key, make_tenant, fake_engine):
    gate = Gate()
    gate.open()
    engine = fake_engine(gate.script)
    key = make_api_key("acme", fair_share_weight=5)

    api.post("chat.completions", valid_body("chat.completions", n=2), headers=key_headers(key))

    tenant = make_tenant("acme")
    assert [(request.tenant, request.tenant_weight) for request in engine.requests] == [(str(tenant.pk), 5)] * 2


def test_with_fair_admission_off_nothing_is_refused_and_no_tenant_is_sent(api, make_api_key, fake_engine, settings):
    settings.SLUICE_FAIR_ADMISSION = False
    gate = Gate()
    engine = fake_engine(gate.script)
    key = make_api_key("acme", max_requests_in_flight=1, fair_share_weight=5)

    async def scenario(client):
        held = [asyncio.create_task(post(client, "chat.completions", key)) for _ in range(3)]
        await _until(lambda: len(engine.requests) == 3)
        gate.open()
        return await asyncio.gather(*held)

    responses = run(scenario)

    assert [response.status_code for response in responses] == [200, 200, 200]
    assert {(request.tenant, request.tenant_weight) for request in engine.requests} == {("", 1)}
