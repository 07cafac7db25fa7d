"""Sending a case and judging the answer: no 5xx, the protocol's error shape on every 4xx (with the
field named in a 400 about a JSON object's content, and Allow on a 405), well-formed streams."""

import json
import socket

import httpx

from bench.fuzz_api.cases import FuzzCase, RawCase

REQUEST_TIMEOUT_S = 120.0


def send(client: httpx.Client, case: FuzzCase) -> httpx.Response:
    content = iter([case.content[:7], case.content[7:]]) if case.chunked else case.content
    headers = [(name.encode(), value.encode("latin-1")) for name, value in case.headers.items()]
    return client.request(case.method, case.path, headers=headers, content=content)


def problems(case: FuzzCase, response: httpx.Response) -> list[str]:
    """What is wrong with the response to `case`: each problem a short kind, the same for alike ones."""
    status = response.status_code
    if status >= 500:
        return [f"status {status}"]
    if status >= 400:
        return _error_shape_problems(case, response)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _stream_problems(response.text)
    try:
        response.json()
    except ValueError:
        return [f"status {status} with a body that is not JSON"]
    return []


def _error_shape_problems(case: FuzzCase, response: httpx.Response) -> list[str]:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        return [f"status {status} with a body that is not JSON"]
    found = []
    if case.anthropic_shaped():
        if not (isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error"):
            return [f"status {status} not in Anthropic's error shape"]
        if set(body["error"]) != {"type", "message"} or not body["error"]["message"]:
            found.append(f"status {status}: Anthropic error without type and message")
    else:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or set(body) != {"error"} or set(error) != {"message", "type", "param", "code"}:
            return [f"status {status} not in OpenAI's error shape"]
        # A refusal of a JSON object's content names the field it is about (JSON that does not parse,
        # or is not an object, has no field to name).
        if status == 400 and case.body_is_object and error["param"] is None:
            found.append(f"400 without param: {error['message'][:60]}")
    if status == 405 and "allow" not in response.headers:
        found.append("405 without Allow")
    return found


def _stream_problems(text: str) -> list[str]:
    for frame in text.split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[len("data: ") :])
                error = data.get("error") if isinstance(data, dict) else None
                if isinstance(error, dict) and error.get("type") in ("server_error", "api_error"):
                    return [f"stream ended with a server error: {error.get('message', '')[:60]}"]
    return []


def send_raw(base_url: httpx.URL, case: RawCase) -> bytes:
    """Everything the server sends back until it closes the connection (or goes quiet)."""
    reply = b""
    with socket.create_connection((base_url.host, base_url.port), timeout=REQUEST_TIMEOUT_S) as connection:
        connection.sendall(case.data)
        try:
            while chunk := connection.recv(65536):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return reply


def raw_problems(reply: bytes) -> tuple[int, list[str]]:
    """(status, problems) of the first response in `reply`. Which protocol's shape a 4xx takes depends
    on how much of the request the server could read, so either is right."""
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        return 0, ["no HTTP response"]
    status = int(status_line[1])
    if status >= 500:
        return status, [f"status {status}"]
    if status < 400:
        return status, []
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunked(body)
    try:
        payload, _ = json.JSONDecoder().raw_decode(body.decode("utf-8"))
    except ValueError:
        return status, [f"raw: status {status} with a body that is not JSON"]
    openai_shaped = isinstance(payload, dict) and set(payload) == {"error"} and isinstance(payload["error"], dict)
    anthropic_shaped = isinstance(payload, dict) and payload.get("type") == "error" and "error" in payload
    return status, [] if openai_shaped or anthropic_shaped else [f"raw: status {status} in neither error shape"]


def _dechunked(body: bytes) -> bytes:
    data = b""
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            return data
        data, body = data + rest[:size], rest[size + 2 :]


def exchange(client: httpx.Client, case: "FuzzCase | RawCase") -> tuple[int, list[str], str]:
    """Sends the case: (status, problems found, the start of the reply)."""
    if isinstance(case, RawCase):
        reply = send_raw(client.base_url, case)
        return *raw_problems(reply), reply[:300].decode("latin-1")
    response = send(client, case)
    return response.status_code, problems(case, response), response.text[:300]
