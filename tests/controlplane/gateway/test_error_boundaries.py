"""Every way the gateway refuses a request, per protocol: status and body shape. No worker needed."""

import asyncio

import pytest

pytest.importorskip("recipe.api")  # skipped, with the import error, until it exists

from controlplane.gateway.auth import ANONYMOUS_TENANT, warn_open_mode  # noqa: E402
from controlplane.tenants.models import ApiKey, Tenant  # noqa: E402
from controlplane.tenants.services import api_key_revoke  # noqa: E402
from tests.controlplane.gateway.helpers import (  # noqa: E402
    ALL_PROTOCOLS,
    GENERATION_PROTOCOLS,
    PATHS,
    assert_error,
    key_headers,
    valid_body,
)
from workers.protocol.messages import WorkerHeartbeat  # noqa: E402

OPENAI_AUTH = "authentication_error"
HEADERS = ["authorization", "x-api-key"]


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_missing_key_is_401(api, make_api_key, protocol):
    make_api_key()  # a key exists, so the gateway is not open

    error = assert_error(api.post(protocol, valid_body(protocol)), protocol, 401, "authentication_error")

    if not protocol.startswith("messages"):
        assert error["code"] == "invalid_api_key"


def test_models_needs_a_key(api, make_api_key):
    make_api_key()
    assert_error(api.request("GET", "/v1/models"), "models", 401, OPENAI_AUTH)


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_bad_key_is_401_from_either_header(api, make_api_key, protocol, header):
    raw_key = make_api_key()
    wrong = raw_key[:-4] + "xxxx"

    response = api.post(protocol, valid_body(protocol), headers=key_headers(wrong, header))

    assert_error(response, protocol, 401, "authentication_error")


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_a_revoked_key_is_refused_at_once(api, make_api_key, protocol, header):
    # given: a key that works (the unknown model is refused after authentication)
    raw_key = make_api_key()
    body = valid_body(protocol, model="no-such-model")
    assert api.post(protocol, body, headers=key_headers(raw_key, header)).status_code == 404

    # when
    api_key_revoke(api_key=ApiKey.objects.get())

    # then
    assert_error(api.post(protocol, body, headers=key_headers(raw_key, header)), protocol, 401, "authentication_error")


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_unknown_model_is_404(api, make_api_key, protocol):
    response = api.post(protocol, valid_body(protocol, model="no-such-model"), headers=key_headers(make_api_key()))

    error = assert_error(response, protocol, 404, "not_found_error")

    if not protocol.startswith("messages"):
        assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_malformed_json_is_400(api, make_api_key, protocol):
    headers = {**key_headers(make_api_key()), "content-type": "application/json"}

    for content in [b'{"model": "smollm2-135m-instruct", ', b"[1, 2]", b"\xff\xfe{}", b"[" * 100_000]:
        response = api.request("POST", PATHS[protocol], content=content, headers=headers)
        assert_error(response, protocol, 400, "invalid_request_error")


@pytest.mark.parametrize("protocol", GENERATION_PROTOCOLS)
def test_invalid_fields_are_400(api, make_api_key, protocol):
    headers = key_headers(make_api_key())
    missing_input = {"model": valid_body(protocol)["model"]}

    assert_error(api.post(protocol, missing_input, headers=headers), protocol, 400, "invalid_request_error")
    assert_error(
        api.post(protocol, valid_body(protocol, temperature="hot"), headers=headers),
        protocol,
        400,
        "invalid_request_error",
    )


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_a_prompt_over_the_context_window_is_400(api, make_api_key, protocol):
    long_message = [{"role": "user", "content": "hello " * 10_000}]  # SmolLM2's window is 8192 tokens

    response = api.post(protocol, valid_body(protocol, messages=long_message), headers=key_headers(make_api_key()))

    assert_error(response, protocol, 400, "invalid_request_error")


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_body_over_the_limit_is_413(api, make_api_key, settings, protocol):
    settings.SLUICE_MAX_BODY_BYTES = 1000
    body = valid_body(protocol, metadata={"padding": "x" * 1000})
    expected_type = "request_too_large" if protocol.startswith("messages") else "invalid_request_error"

    assert_error(api.post(protocol, body, headers=key_headers(make_api_key())), protocol, 413, expected_type)


@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_a_body_without_content_length_is_cut_off_at_the_limit(api, make_api_key, settings, protocol):
    # given: a chunked upload that never ends by itself
    settings.SLUICE_MAX_BODY_BYTES = 10_000
    sent = []

    async def endless_body():
        while True:
            sent.append(1000)
            yield b" " * 1000
            await asyncio.sleep(0)  # as a network would, let others run between chunks

    # when
    response = api.request(
        "POST", PATHS[protocol], content=endless_body(), headers=key_headers(make_api_key(), "x-api-key")
    )

    # then: refused, and no more of it was read than the limit (plus one chunk)
    expected_type = "request_too_large" if protocol.startswith("messages") else "invalid_request_error"
    assert_error(response, protocol, 413, expected_type)
    assert sum(sent) <= 12_000


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_past_the_tenants_rate_limit_is_429_with_retry_after(api, make_api_key, protocol):
    # given: 2 requests per minute (cheap 404s use them up)
    headers = key_headers(make_api_key(rate_limit_rpm=2))
    body = valid_body(protocol, model="no-such-model")
    assert [api.post(protocol, body, headers=headers).status_code for _ in range(2)] == [404, 404]

    # when
    response = api.post(protocol, body, headers=headers)

    # then
    expected_type = "rate_limit_error" if protocol.startswith("messages") else "rate_limit_exceeded"
    assert_error(response, protocol, 429, expected_type)
    assert 1 <= int(response.headers["retry-after"]) <= 30


def test_rate_limits_are_per_tenant(api, make_api_key):
    limited = key_headers(make_api_key("limited", rate_limit_rpm=1))
    other = key_headers(make_api_key("other", rate_limit_rpm=1))
    body = valid_body("chat.completions", model="no-such-model")

    statuses = [
        api.post("chat.completions", body, headers=headers).status_code for headers in (limited, limited, other)
    ]

    assert statuses == [404, 429, 404]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("protocol", "status"), [("chat.completions", 503), ("completions", 503), ("responses", 503), ("messages", 529)]
)
def test_no_worker_alive_is_overloaded(api, make_api_key, no_workers, protocol, status, stream):
    response = api.post(protocol, valid_body(protocol, stream=stream), headers=key_headers(make_api_key()))

    assert_error(response, protocol, status, "overloaded_error")


def test_a_configured_worker_that_never_answers_is_503(api, make_api_key, settings, tmp_path, monkeypatch):
    settings.SLUICE_WORKER_ENDPOINTS = [(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/hb")]
    monkeypatch.setattr("controlplane.gateway.engine.FIRST_HEARTBEAT_WAIT_S", 0.05)

    response = api.post("chat.completions", valid_body("chat.completions"), headers=key_headers(make_api_key()))

    assert_error(response, "chat.completions", 503, "overloaded_error")


def test_healthz_is_503_without_workers(api, no_workers):
    response = api.request("GET", "/healthz")

    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "workers": []}


def test_an_unexpected_failure_is_500_without_details(api, make_api_key, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("internal detail")

    monkeypatch.setattr("controlplane.gateway.prepare_jobs.prepare_request", broken)

    for protocol, error_type in [("chat.completions", "server_error"), ("messages", "api_error")]:
        response = api.post(protocol, valid_body(protocol), headers=key_headers(make_api_key()))
        error = assert_error(response, protocol, 500, error_type)
        assert "internal detail" not in response.text and error["message"]

    assert "internal detail" in caplog.text and "Traceback" in caplog.text


def test_open_mode_without_any_key_serves_everyone_as_anonymous(api, no_workers, caplog):
    # given: no API key at all
    warn_open_mode.cache_clear()

    # when: no key, and a key that does not exist
    responses = [
        api.post("chat.completions", valid_body("chat.completions")),
        api.post("messages", valid_body("messages"), headers=key_headers("sk-sluice-nothing", "x-api-key")),
    ]

    # then: authenticated (refused later, for want of a worker), as tenant "anonymous", loudly
    assert [response.status_code for response in responses] == [503, 529]
    assert Tenant.objects.filter(name=ANONYMOUS_TENANT).count() == 1
    assert caplog.text.count("gateway is OPEN") == 1


@pytest.mark.parametrize(("state", "status"), [("ready", 200), ("draining", 503), ("drained", 503)])
def test_healthz_counts_only_workers_that_take_requests(api, monkeypatch, state, status):
    heartbeat = WorkerHeartbeat(
        worker_id="w0",
        role="mixed",
        model="m",
        request_endpoint="ipc:///w0",
        max_model_len=8192,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=10,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=0.0,
        state=state,
    )

    class Client:
        def healthy_workers(self):
            return [heartbeat]

    async def engine_client():
        return Client()

    monkeypatch.setattr("controlplane.gateway.views.engine_client", engine_client)

    response = api.request("GET", "/healthz")

    assert response.status_code == status
    assert [worker["state"] for worker in response.json()["workers"]] == [state]
