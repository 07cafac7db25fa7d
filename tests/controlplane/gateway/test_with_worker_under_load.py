"""The gateway under a hostile tenant, live (a real SmolLM2 worker, uvicorn over TCP): the largest
legal bodies are prepared away from the event loop, and a client that stops reading a stream is
aborted in the worker once its buffer is full."""

import json
import socket
import threading

import httpx
import pytest
from django.test import override_settings

from controlplane.gateway.tenant_caps import loads
from tests.controlplane.gateway.helpers import PATHS, key_headers, sse_frames, valid_body
from tests.controlplane.gateway.live import live_gateway
from tests.waiting import wait_until
from workers.client.engine_client import EngineClient
from workers.protocol.messages import AbortRequest

# The server's threads only see committed rows.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORDS = "the quick brown fox jumps over a lazy dog while counting sheep; "
LARGEST_BODY_BYTES = 3_900_000
# Small socket buffers on both ends, so that a client that stops reading makes the server's sends
# block after kilobytes rather than megabytes (loopback buffers grow to megabytes otherwise).
SOCKET_BUFFER_BYTES = 4096
STREAM_BUFFER_OUTPUTS = 16


def text_of(size: int) -> str:
    return (WORDS * (size // len(WORDS) + 1))[:size]


@pytest.fixture(scope="module")
def gateway_url(smollm2_worker, django_db_setup, django_db_blocker) -> str:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)  # accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    with live_gateway(smollm2_worker, django_db_blocker, listener) as url:
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


def _request_bytes(path: str, body: dict, key: str) -> bytes:
    content = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {key}\r\ncontent-length: {len(content)}\r\n\r\n"
    )
    return head.encode() + content


def _read_head(connection: socket.socket) -> tuple[bytes, bytes]:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(1)
        assert chunk, "the server closed the connection before the response head"
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    return head, rest


def _recv(connection: socket.socket) -> bytes:
    chunk = connection.recv(65536)
    assert chunk, "the server closed the connection mid-response"
    return chunk


def _read_chunked_body(connection: socket.socket, received: bytes) -> bytes:
    """The rest of a chunked response body, up to its last (empty) chunk."""
    body = b""
    while True:
        while b"\r\n" not in received:
            received += _recv(connection)
        size_line, _, received = received.partition(b"\r\n")
        size = int(size_line, 16)
        while len(received) < size + 2:
            received += _recv(connection)
        body, received = body + received[:size], received[size + 2 :]
        if size == 0:
            return body


def _running(gateway_url: str) -> int:
    workers = httpx.get(f"{gateway_url}/healthz", timeout=30).json()["workers"]
    return sum(worker["num_running"] for worker in workers)


def test_a_client_that_stops_reading_a_stream_is_aborted_in_the_worker(gateway_url, make_api_key, monkeypatch):
    # given: the aborts the gateway sends to the worker, recorded
    aborted: list[str] = []
    send_now = EngineClient.send_now

    def recording_send_now(self, link, message):
        if isinstance(message, AbortRequest):
            aborted.append(message.request_id)
        send_now(self, link, message)

    monkeypatch.setattr(EngineClient, "send_now", recording_send_now)
    # ignore_eos: the stream must outlast the buffers whatever the greedy text is on this CPU's numerics
    body = valid_body(
        "completions", prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=1000, temperature=0, stream=True, ignore_eos=True
    )
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    connection.connect(("127.0.0.1", int(gateway_url.rsplit(":", 1)[1])))

    with override_settings(SLUICE_STREAM_BUFFER_OUTPUTS=STREAM_BUFFER_OUTPUTS), connection:
        # when: the client reads the response head and nothing more
        connection.sendall(_request_bytes(PATHS["completions"], body, make_api_key()))
        head, rest = _read_head(connection)
        assert head.startswith(b"HTTP/1.1 200"), head

        # then: the gateway aborts it in the worker, which stops running it, long before 1000 tokens
        wait_until(lambda: any(request_id.startswith("cmpl-") for request_id in aborted), timeout_s=120)
        wait_until(lambda: _running(gateway_url) == 0, timeout_s=30)
        # and a client that reads again gets what was buffered, then the reason in an error event
        frames = sse_frames(_read_chunked_body(connection, rest).decode())

    *chunks, (event, data) = frames
    assert event is None
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error"
    assert f"the client left {STREAM_BUFFER_OUTPUTS} outputs unread" in error["message"]
    assert 0 < len(chunks) < 1000
