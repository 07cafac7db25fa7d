"""The gateway under a hostile tenant, live (a real SmolLM2 worker, uvicorn over TCP): the largest
legal bodies are prepared away from the event loop."""

import threading

import httpx
import pytest

from controlplane.gateway.tenant_caps import loads
from tests.controlplane.gateway.helpers import PATHS, key_headers, valid_body
from tests.controlplane.gateway.live import live_gateway
from tests.waiting import wait_until

# The server's threads only see committed rows.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORDS = "the quick brown fox jumps over a lazy dog while counting sheep; "
LARGEST_BODY_BYTES = 3_900_000


def text_of(size: int) -> str:
    return (WORDS * (size // len(WORDS) + 1))[:size]


@pytest.fixture(scope="module")
def gateway_url(smollm2_worker, django_db_setup, django_db_blocker) -> str:
    with live_gateway(smollm2_worker, django_db_blocker) as url:
        yield url


def test_health_checks_and_another_tenants_chat_are_answered_while_the_largest_bodies_are_prepared(
    gateway_url, make_api_key, make_tenant
):
    # given: tenant "heavy" sends four count_tokens bodies of 3.9 MB and two chats as large, far over
    # the context window, all at once
    heavy_key, light_key = make_api_key("heavy"), make_api_key("light")
    heavy = make_tenant("heavy")
    messages = [{"role": "user", "content": text_of(LARGEST_BODY_BYTES)}]
    finished: list[str] = []
    responses: dict[str, httpx.Response] = {}

    def call(label: str, method: str, path: str, **kwargs) -> None:
        with httpx.Client(base_url=gateway_url, timeout=600) as client:
            responses[label] = client.request(method, path, **kwargs)
        finished.append(label)

    count_body = valid_body("messages.count_tokens", messages=messages)
    chat_body = valid_body("chat.completions", messages=messages)
    heavy_calls = [(f"count-{i}", PATHS["messages.count_tokens"], count_body) for i in range(4)]
    heavy_calls += [(f"chat-{i}", PATHS["chat.completions"], chat_body) for i in range(2)]
    threads = [
        threading.Thread(
            target=call, args=(label, "POST", path), kwargs={"json": body, "headers": key_headers(heavy_key)}
        )
        for label, path, body in heavy_calls
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: loads.load(heavy.pk)[0] == len(heavy_calls), timeout_s=120)

    # when: while all six are in flight, a health check and a small chat of another tenant
    call("healthz", "GET", "/healthz")
    call(
        "small chat",
        "POST",
        PATHS["chat.completions"],
        json=valid_body("chat.completions"),
        headers=key_headers(light_key),
    )
    for thread in threads:
        thread.join(timeout=600)

    # then: those two were answered first, and the large ones were answered in full
    assert finished[:2] == ["healthz", "small chat"], finished
    assert responses["healthz"].status_code == 200
    assert responses["small chat"].status_code == 200, responses["small chat"].text
    for i in range(4):
        assert responses[f"count-{i}"].status_code == 200, responses[f"count-{i}"].text
        assert responses[f"count-{i}"].json()["input_tokens"] > 500_000
    for i in range(2):
        assert responses[f"chat-{i}"].status_code == 400
        assert "context" in responses[f"chat-{i}"].json()["error"]["message"]
