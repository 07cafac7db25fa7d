"""Cache hints through the gateway, called with the official SDKs (in-process, against a fake engine
that reports what the store did): the hints and the scoped cache namespace reach the engine, usage
comes back in each SDK's types, and an invalid hint is the protocol's 400."""

from collections.abc import Awaitable, Callable

import anthropic
import httpx
import httpx2
import openai
import pytest
from asgiref.sync import async_to_sync

from controlplane.asgi import application
from controlplane.tenants.models import Tenant
from tests.controlplane.gateway.helpers import SMOLLM2, FakeEngine
from workers.kvstore.block_hash import scoped_namespace
from workers.protocol.messages import CacheHint, GenerateOutput

HOUR = {"type": "ephemeral", "ttl": "1h"}


def stored_script(*, cached: int, stored: int):
    """Two outputs; the prompt had `cached` tokens cached and `stored` written, each hint's share
    being 64 tokens."""

    async def script(request):
        for index in range(2):
            yield GenerateOutput(
                request_id=request.request_id,
                token_ids=[28 + index],
                text="a",
                finish_reason="stop" if index == 1 else None,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=cached,
                num_stored_tokens=stored,
                stored_tokens_by_hint=(64,) * len(request.cache_hints),
            )

    return script


def openai_call(raw_key: str, call: Callable[[openai.AsyncOpenAI], Awaitable]):
    async def run():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = openai.AsyncOpenAI(
                base_url="http://testserver/v1", api_key=raw_key, http_client=http, max_retries=0
            )
            return await call(client)

    return async_to_sync(run)()


def anthropic_call(raw_key: str, call: Callable[[anthropic.AsyncAnthropic], Awaitable]):
    async def run():
        # This SDK runs on httpx2, which has the same in-process transport.
        transport = httpx2.ASGITransport(app=application)
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://testserver", api_key=raw_key, http_client=http, max_retries=0
            )
            return await call(client)

    return async_to_sync(run)()


@pytest.fixture
def engine(api, fake_engine) -> FakeEngine:
    return fake_engine(stored_script(cached=0, stored=128))


def test_openai_chat_sends_the_retention_and_the_keyed_namespace(engine, make_api_key):
    raw_key = make_api_key("acme")

    completion = openai_call(
        raw_key,
        lambda client: client.chat.completions.create(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=2,
            prompt_cache_key="user-1",
            prompt_cache_retention="24h",
        ),
    )

    [request] = engine.requests
    assert request.cache_hints == (CacheHint(prefix_tokens=len(request.prompt_token_ids), retain_s=86400.0),)
    assert request.cache_namespace == scoped_namespace(Tenant.objects.get(name="acme").cache_namespace, "user-1")
    assert completion.usage.prompt_tokens_details.cache_write_tokens == 128


def test_openai_responses_echo_the_cache_settings(engine, make_api_key):
    response = openai_call(
        make_api_key("acme"),
        lambda client: client.responses.create(
            model=SMOLLM2, input="Hi!", prompt_cache_key="user-2", prompt_cache_retention="in_memory"
        ),
    )

    assert engine.requests[0].cache_hints == ()
    assert (response.prompt_cache_key, response.prompt_cache_retention) == ("user-2", "in_memory")
    assert response.usage.input_tokens_details.cache_write_tokens == 128


def test_anthropic_breakpoints_reach_the_engine_and_usage_reports_creation(engine, make_api_key):
    raw_key = make_api_key("acme")

    message = anthropic_call(
        raw_key,
        lambda client: client.messages.create(
            model=SMOLLM2,
            max_tokens=2,
            system=[{"type": "text", "text": "Be kind.", "cache_control": HOUR}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Hi!", "cache_control": {"type": "ephemeral"}}]}
            ],
        ),
    )

    [request] = engine.requests
    assert [hint.retain_s for hint in request.cache_hints] == [3600.0, 300.0]
    assert request.cache_namespace == Tenant.objects.get(name="acme").cache_namespace
    usage = message.usage
    assert (usage.cache_creation.ephemeral_1h_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens) == (64, 64)
    assert usage.cache_creation_input_tokens == 128 and usage.cache_read_input_tokens == 0
    assert usage.input_tokens == len(request.prompt_token_ids) - 128


def test_anthropic_count_tokens_takes_breakpoints(engine, make_api_key):
    counted = anthropic_call(
        make_api_key("acme"),
        lambda client: client.messages.count_tokens(
            model=SMOLLM2,
            system=[{"type": "text", "text": "Be kind.", "cache_control": HOUR}],
            messages=[{"role": "user", "content": "Hi!"}],
            cache_control={"type": "ephemeral"},
        ),
    )

    assert counted.input_tokens > 0 and engine.requests == []


def test_an_invalid_anthropic_breakpoint_is_the_protocols_400(engine, make_api_key):
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_call(
            make_api_key("acme"),
            lambda client: client.messages.create(
                model=SMOLLM2,
                max_tokens=2,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Hi!", "cache_control": {"type": "ephemeral", "ttl": "2h"}}
                        ],
                    }
                ],
            ),
        )

    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and "`messages[0].content[0].cache_control.ttl`" in error["message"]
    assert engine.requests == []


def test_an_invalid_openai_retention_is_the_protocols_400(engine, make_api_key):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_call(
            make_api_key("acme"),
            lambda client: client.chat.completions.create(
                model=SMOLLM2, messages=[{"role": "user", "content": "Hi!"}], prompt_cache_retention="48h"
            ),
        )

    assert refused.value.param == "prompt_cache_retention" and engine.requests == []


def test_the_same_key_in_two_tenants_names_two_namespaces(engine, make_api_key):
    for tenant in ("acme", "globex"):
        openai_call(
            make_api_key(tenant),
            lambda client: client.chat.completions.create(
                model=SMOLLM2, messages=[{"role": "user", "content": "Hi!"}], max_tokens=2, prompt_cache_key="shared"
            ),
        )

    namespaces = [request.cache_namespace for request in engine.requests]
    tenants = [Tenant.objects.get(name=name).cache_namespace for name in ("acme", "globex")]
    assert namespaces == [scoped_namespace(tenants[0], "shared"), scoped_namespace(tenants[1], "shared")]
    assert len(set(namespaces) | set(tenants)) == 4


def test_openai_explicit_breakpoints_through_the_responses_sdk(engine, make_api_key):
    content = [
        {"type": "input_text", "text": "Rules.", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}},
        {"type": "input_text", "text": "Question?"},
    ]

    response = openai_call(
        make_api_key("acme"),
        lambda client: client.responses.create(
            model=SMOLLM2,
            input=[{"role": "user", "content": content}],
            prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        ),
    )

    [request] = engine.requests
    assert [hint.retain_s for hint in request.cache_hints] == [43200.0]
    details = response.usage.input_tokens_details.cache_write_tokens_details
    assert (details.ttl_12h_tokens, details.ttl_30m_tokens) == (64, 0)
    assert response.prompt_cache_options.mode == "explicit"
