"""A client that stops reading a stream: once SLUICE_STREAM_BUFFER_OUTPUTS outputs wait for it, its
engine requests are aborted (fake engine, the real ASGI application driven as a server would)."""

import asyncio

import pytest
from asgiref.sync import async_to_sync

from controlplane.asgi import application
from controlplane.gateway.tenant_caps import loads
from tests.controlplane.gateway.helpers import PATHS, key_headers, valid_body
from tests.controlplane.gateway.test_generation import _asgi_post
from workers.protocol.messages import GenerateOutput

BUFFER = 8


async def run_with_a_client_that_stops_reading(scope: dict, content: bytes, engine, expected: int, tenant_id: int):
    """The client takes the response head and one body chunk, then reads no more (the server's send
    blocks, as it does once the socket buffers are full) until it hangs up, once the engine saw
    `expected` requests closed early. Returns its tenant's load (calls in flight, queued prompt
    tokens) just before it hung up."""
    stalled, gone = asyncio.Event(), asyncio.Event()
    request_messages = [{"type": "http.request", "body": content, "more_body": False}]

    async def receive():
        if request_messages:
            return request_messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            stalled.set()
            await gone.wait()

    app = asyncio.create_task(application(scope, receive, send))
    async with asyncio.timeout(10):
        await stalled.wait()
        while len(engine.closed_early) < expected:
            await asyncio.sleep(0.01)
    load_while_stalled = loads.load(tenant_id)
    gone.set()
    await asyncio.wait_for(app, timeout=5)
    return load_while_stalled


class Endless:
    """A fake engine script that never finishes; counts the outputs it produced per request."""

    def __init__(self) -> None:
        self.produced: dict[str, int] = {}

    async def script(self, request):
        while True:
            self.produced[request.request_id] = self.produced.get(request.request_id, 0) + 1
            yield GenerateOutput(request_id=request.request_id, token_ids=[28], text="A")
            await asyncio.sleep(0)


@pytest.mark.parametrize(("protocol", "n"), [("chat.completions", 2), ("messages", 1)])
def test_a_client_that_stops_reading_is_aborted_once_its_buffer_is_full(
    api, make_api_key, make_tenant, fake_engine, settings, protocol, n
):
    # given
    settings.SLUICE_STREAM_BUFFER_OUTPUTS = BUFFER
    endless = Endless()
    engine = fake_engine(endless.script)
    body = valid_body(protocol, stream=True, **({"n": n} if n > 1 else {}))
    scope, content = _asgi_post(PATHS[protocol], body, key_headers(make_api_key()))

    # when
    tenant_id = make_tenant("acme").pk
    load_while_stalled = async_to_sync(run_with_a_client_that_stops_reading)(scope, content, engine, n, tenant_id)

    # then: every choice was stopped in the engine, after a bounded number of outputs (the buffer,
    # plus what the response had taken before the client stalled)
    assert sorted(engine.closed_early) == sorted(request.request_id for request in engine.requests)
    produced = endless.produced
    assert len(produced) == n and all(count <= BUFFER + 2 for count in produced.values()), produced
    # The call counts against its tenant's cap while its connection stays open, and not after.
    assert load_while_stalled == (1, 0)
    assert loads.load(tenant_id) == (0, 0)
