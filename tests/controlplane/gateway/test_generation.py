"""Generation orchestration against a fake engine: choices, namespaces, SSE framing, engine errors
and client disconnects."""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync

pytest.importorskip("recipe.api")  # skipped, with the import error, until it exists

from controlplane.asgi import application  # noqa: E402
from controlplane.tenants.models import SHARED_CACHE_NAMESPACE, Tenant  # noqa: E402
from tests.controlplane.gateway.helpers import (  # noqa: E402
    PATHS,
    FakeEngine,
    assert_error,
    key_headers,
    sse_frames,
    valid_body,
)
from workers.client.worker_link import RequestRejectedError, WorkerUnavailableError  # noqa: E402
from workers.protocol.messages import GenerateOutput, GrammarLimits  # noqa: E402

WORDS = ["Hello", " there", "!"]


@pytest.fixture
def words_script(smollm2_tokenizer):
    """Each request says "Hello there!" in three outputs and stops."""

    async def script(request):
        for index, word in enumerate(WORDS):
            last = index == len(WORDS) - 1
            yield GenerateOutput(
                request_id=request.request_id,
                token_ids=smollm2_tokenizer.encode(word),
                text=word,
                finish_reason="stop" if last else None,
                num_prompt_tokens=len(request.prompt_token_ids),
            )

    return script


def failing_script(error: Exception, *, after: int):
    async def script(request):
        for _ in range(after):
            yield GenerateOutput(request_id=request.request_id, token_ids=[28], text="A")
        raise error

    return script


def test_n_choices_become_n_engine_requests_in_the_tenants_namespace(api, make_api_key, fake_engine, words_script):
    # given
    engine = fake_engine(words_script)
    raw_key = make_api_key("acme")

    # when
    response = api.post("chat.completions", valid_body("chat.completions", n=2), headers=key_headers(raw_key))

    # then
    assert response.status_code == 200, response.text
    body = response.json()
    assert [choice["message"]["content"] for choice in body["choices"]] == ["Hello there!", "Hello there!"]
    assert [request.request_id for request in engine.requests] == [f"{body['id']}-0", f"{body['id']}-1"]
    namespace = Tenant.objects.get(name="acme").cache_namespace
    assert {request.cache_namespace for request in engine.requests} == {namespace}
    assert engine.closed_early == []


def test_tenants_sharing_the_prefix_cache_use_the_shared_namespace(api, make_api_key, fake_engine, words_script):
    engine = fake_engine(words_script)
    raw_key = make_api_key("acme", share_prefix_cache=True)

    api.post("messages", valid_body("messages"), headers=key_headers(raw_key, "x-api-key"))

    assert engine.requests[0].cache_namespace == SHARED_CACHE_NAMESPACE


def test_chat_stream_is_sse_ending_with_done(api, make_api_key, fake_engine, words_script):
    fake_engine(words_script)

    response = api.post(
        "chat.completions", valid_body("chat.completions", stream=True), headers=key_headers(make_api_key())
    )

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(response.text)
    assert all(event is None for event, _ in frames)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == "Hello there!"


def test_messages_stream_names_its_events(api, make_api_key, fake_engine, words_script):
    fake_engine(words_script)

    response = api.post(
        "messages", valid_body("messages", stream=True), headers=key_headers(make_api_key(), "x-api-key")
    )

    assert response.status_code == 200
    frames = sse_frames(response.text)
    assert frames[0][0] == "message_start" and frames[-1][0] == "message_stop"
    assert all(event == json.loads(data)["type"] for event, data in frames)


@pytest.mark.parametrize(
    ("error", "protocol", "status", "error_type"),
    [
        (
            RequestRejectedError("invalid_request", "prompt too long here"),
            "chat.completions",
            400,
            "invalid_request_error",
        ),
        (RequestRejectedError("invalid_request", "prompt too long here"), "messages", 400, "invalid_request_error"),
        (RequestRejectedError("overloaded", "queue full"), "chat.completions", 503, "overloaded_error"),
        (RequestRejectedError("overloaded", "queue full"), "messages", 529, "overloaded_error"),
        (RequestRejectedError("internal", "engine bug"), "chat.completions", 500, "server_error"),
        (RequestRejectedError("internal", "engine bug"), "messages", 500, "api_error"),
        (WorkerUnavailableError("worker restarted"), "responses", 503, "overloaded_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_before_any_output_get_an_http_status(
    api, make_api_key, fake_engine, error, protocol, status, error_type, stream
):
    fake_engine(failing_script(error, after=0))

    response = api.post(protocol, valid_body(protocol, stream=stream), headers=key_headers(make_api_key()))

    error_object = assert_error(response, protocol, status, error_type)
    # The client learns why its request is invalid, never the details of an internal failure.
    assert ("prompt too long here" in error_object["message"]) == (status == 400)
    assert "engine bug" not in response.text


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_an_engine_error_mid_stream_ends_the_stream_with_an_error_event(api, make_api_key, fake_engine, protocol):
    fake_engine(failing_script(WorkerUnavailableError("worker went away"), after=2))

    response = api.post(protocol, valid_body(protocol, stream=True), headers=key_headers(make_api_key()))

    assert response.status_code == 200
    event, data = sse_frames(response.text)[-1]
    if protocol == "messages":
        assert event == "error"
        assert json.loads(data) == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": json.loads(data)["error"]["message"]},
        }
    else:
        assert event is None and json.loads(data)["error"]["type"] == "overloaded_error"


def test_one_failing_choice_stops_the_others(api, make_api_key, fake_engine):
    # given: choice 1 is refused while choice 0 would run forever
    async def script(request):
        if request.request_id.endswith("-1"):
            raise RequestRejectedError("overloaded", "full")
        while True:
            yield GenerateOutput(request_id=request.request_id, token_ids=[28], text="A")
            await asyncio.sleep(0.01)

    engine = fake_engine(script)

    # when
    response = api.post("chat.completions", valid_body("chat.completions", n=2), headers=key_headers(make_api_key()))

    # then
    assert response.status_code == 503
    assert engine.closed_early == [engine.requests[0].request_id]


def _asgi_post(path: str, body: dict, headers: dict[str, str]) -> tuple[dict, bytes]:
    """An HTTP scope as a server would build it, and the body."""
    content = json.dumps(body).encode()
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            *((name.encode(), value.encode()) for name, value in headers.items()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }, content


async def run_and_disconnect(scope: dict, content: bytes, engine: FakeEngine, expected: int) -> tuple[list, list]:
    """Runs the ASGI app as a server would for a client that hangs up after the first body chunk;
    returns what was sent and the requests the engine saw closed early within a second after that."""
    got_body = asyncio.Event()
    request_messages = [{"type": "http.request", "body": content, "more_body": False}]
    sent = []

    async def receive():
        if request_messages:
            return request_messages.pop()
        await got_body.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_body.set()

    app = asyncio.create_task(application(scope, receive, send))
    await asyncio.wait_for(got_body.wait(), timeout=10)
    for _ in range(100):
        if len(engine.closed_early) >= expected:
            break
        await asyncio.sleep(0.01)
    closed_early = list(engine.closed_early)
    await asyncio.wait_for(app, timeout=5)
    return sent, closed_early


@pytest.mark.parametrize(("protocol", "n"), [("chat.completions", 2), ("messages", 1)])
def test_a_client_that_disconnects_stops_every_running_choice(api, make_api_key, fake_engine, protocol, n):
    # given: choices that would never end
    async def endless(request):
        while True:
            yield GenerateOutput(request_id=request.request_id, token_ids=[28], text="A")
            await asyncio.sleep(0.01)

    engine = fake_engine(endless)
    body = valid_body(protocol, stream=True, **({"n": n} if n > 1 else {}))
    scope, content = _asgi_post(PATHS[protocol], body, key_headers(make_api_key()))

    # when
    sent, closed_early = async_to_sync(run_and_disconnect)(scope, content, engine, n)

    # then
    assert sent[0]["status"] == 200
    assert len(engine.requests) == n
    assert sorted(closed_early) == sorted(request.request_id for request in engine.requests)


def constrained_body(protocol: str, **fields) -> dict:
    """A body whose output constraint comes from the field each protocol names it by."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    constrained = {
        "chat.completions": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        },
        "chat.completions tools": {"tools": [tool], "tool_choice": "required"},
        "responses": {"text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}},
        "messages": {"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}},
    }
    return valid_body(protocol.split()[0], **constrained[protocol], **fields)


def test_a_constraint_goes_to_the_engine_with_the_gateways_grammar_limits(
    api, make_api_key, fake_engine, words_script, settings
):
    settings.SLUICE_GRAMMAR_LIMITS = GrammarLimits(max_regex_repeat=77, step_lexer_fuel=1234)
    engine = fake_engine(words_script)

    api.post("chat.completions", constrained_body("chat.completions"), headers=key_headers(make_api_key()))

    assert engine.requests[0].constraint.limits == GrammarLimits(max_regex_repeat=77, step_lexer_fuel=1234)


CONSTRAINT_FIELDS = [
    ("chat.completions", "response_format"),
    ("chat.completions tools", "tools"),
    ("responses", "text.format"),
    ("messages", None),  # Anthropic's errors name no field
]


@pytest.mark.parametrize(("protocol", "param"), CONSTRAINT_FIELDS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_worker_refuses_is_a_400_naming_its_field(
    api, make_api_key, fake_engine, protocol, param, stream
):
    fake_engine(failing_script(RequestRejectedError("invalid_constraint", "invalid JSON schema: too big"), after=0))

    response = api.post(
        protocol.split()[0], constrained_body(protocol, stream=stream), headers=key_headers(make_api_key())
    )

    error = assert_error(response, protocol.split()[0], 400, "invalid_request_error")
    assert error["message"] == "invalid JSON schema: too big" and error.get("param") == param


@pytest.mark.parametrize(("protocol", "param"), CONSTRAINT_FIELDS)
def test_a_constraint_failing_mid_stream_ends_it_with_an_error_event_naming_its_field(
    api, make_api_key, fake_engine, protocol, param
):
    failure = RequestRejectedError("invalid_constraint", "the output constraint failed: lexer error")
    fake_engine(failing_script(failure, after=2))

    response = api.post(
        protocol.split()[0], constrained_body(protocol, stream=True), headers=key_headers(make_api_key())
    )

    assert response.status_code == 200
    _, data = sse_frames(response.text)[-1]
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == "the output constraint failed: lexer error"
    assert error.get("param") == param


def test_a_worker_that_failed_as_a_whole_is_a_server_error_without_its_details(api, make_api_key, fake_engine):
    fake_engine(failing_script(RequestRejectedError("worker_failed", "the engine worker p0 failed"), after=0))

    response = api.post("chat.completions", valid_body("chat.completions"), headers=key_headers(make_api_key()))

    assert_error(response, "chat.completions", 500, "server_error")
    assert "p0" not in response.text
