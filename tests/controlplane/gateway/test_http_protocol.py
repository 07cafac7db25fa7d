"""The gateway's uvicorn protocol: connections that never finish a request head are closed, requests
that did are served however long they take. A real uvicorn server on a socket, with a small app."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.main import main as uvicorn_cli

from controlplane.gateway.http_protocol import HeadDeadlineH11Protocol
from controlplane.management.commands.serve import GATEWAY_HTTP_OPTIONS

HEAD_DEADLINE_S = 0.3
SLOW_RESPONSE_S = 3 * HEAD_DEADLINE_S


async def slow_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(SLOW_RESPONSE_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server_address(settings) -> Iterator[tuple[str, int]]:
    settings.SLUICE_HEADER_READ_TIMEOUT_S = HEAD_DEADLINE_S
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(slow_app, http=HeadDeadlineH11Protocol, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield listener.getsockname()
    server.should_exit = True
    thread.join(timeout=10)


def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (reading whatever it sent first)."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_connection_that_sends_nothing_is_closed(server_address):
    with socket.create_connection(server_address) as connection:
        assert closed_within(connection, HEAD_DEADLINE_S + 2)


def test_a_head_sent_a_byte_at_a_time_is_closed_at_the_deadline(server_address):
    with socket.create_connection(server_address) as connection:
        started = time.monotonic()
        connection.settimeout(1)
        try:
            for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                connection.send(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass

        assert closed_within(connection, 2)
        assert time.monotonic() - started < HEAD_DEADLINE_S + 2


def test_a_request_slower_than_the_deadline_is_served_and_its_idle_connection_closed(server_address):
    with socket.create_connection(server_address) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        connection.settimeout(SLOW_RESPONSE_S + 5)

        response = b""
        while not response.endswith(b"ok"):  # the head and the body may come in separate segments
            chunk = connection.recv(4096)
            assert chunk, response
            response += chunk

        assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"ok")
        assert closed_within(connection, HEAD_DEADLINE_S + 2)  # well before uvicorn's 5 s keep-alive


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000,  # a head that grows past 16 KiB unfinished
        b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n",
    ],
)
def test_a_request_that_is_not_http_gets_a_json_400(server_address, request_bytes):
    with socket.create_connection(server_address, timeout=5) as connection:
        connection.sendall(request_bytes)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk

    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_serve_passes_uvicorn_options_it_knows():
    context = uvicorn_cli.make_context("uvicorn", ["controlplane.asgi:application", *GATEWAY_HTTP_OPTIONS])

    assert context.params["http"] == "controlplane.gateway.http_protocol:HeadDeadlineH11Protocol"
    assert context.params["timeout_keep_alive"] == 5
