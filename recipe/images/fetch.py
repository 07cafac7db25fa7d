"""Fetching an image URL without letting the client reach what the gateway can reach.

Each hop (the URL, then each redirect, at most MAX_REDIRECTS) resolves its host once, refuses it
unless every address is allowed (destinations.is_public_address), and connects to the checked
address itself, with the original host in `Host` and in TLS's SNI and certificate check: the name is
never resolved a second time, so a DNS answer that changes between check and connect (rebinding)
reaches nothing. The whole fetch, redirects included, has one deadline; the body is streamed and
abandoned past `max_bytes`; only `image/*` responses are read.

Why not deepseek-recipe's ReqwestImageFetcher: it takes a destination filter (asked after resolution
and on redirects; it ships no rule, destinations.py is ours) and a byte limit, but it accepts any
content type (tests/controlplane/gateway/test_image_fetch.py shows it) and has no time limit to set (a
server that stalled 30 s held its fetch 30 s).

Not bounded by the deadline: the system resolver (getaddrinfo), whose own timeouts apply.
"""

import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from recipe.images.destinations import IpAddress, is_public_address

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}

AddressFilter = Callable[[IpAddress], bool]


class FetchRefused(Exception):
    """An image URL that was not fetched, or not wholly: the message says why, for the client."""


@dataclass(frozen=True, slots=True)
class FetchedImage:
    data: bytes
    content_type: str


def fetch_image(
    url: str, *, max_bytes: int, timeout_s: float, is_allowed: AddressFilter = is_public_address
) -> FetchedImage:
    """Raises FetchRefused. `is_allowed` is the address rule (tests swap it to reach a local server)."""
    deadline = time.monotonic() + timeout_s
    target = _parsed(url)
    with httpx.Client(trust_env=False, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            address = _checked_address(target, is_allowed)
            request = client.build_request(
                "GET",
                target.copy_with(host=str(address)),
                headers={"host": _host_header(target), "accept": "image/*"},
                extensions={"sni_hostname": target.host, "timeout": _timeouts(deadline)},
            )
            try:
                response = client.send(request, stream=True)
            except httpx.TimeoutException:
                raise FetchRefused("it took longer than the fetch timeout") from None
            except httpx.HTTPError as error:
                raise FetchRefused(f"it could not be fetched ({type(error).__name__})") from None
            try:
                if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
                    target = _parsed(str(target.join(response.headers["location"])))
                    continue
                return _image_body(response, max_bytes, deadline)
            finally:
                response.close()
    raise FetchRefused(f"it redirects more than {MAX_REDIRECTS} times")


def _parsed(url: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise FetchRefused(f"it is not a valid URL ({error})") from None
    if target.scheme not in _DEFAULT_PORTS or not target.host:
        raise FetchRefused("it is not an http(s) URL with a host")
    return target


def _checked_address(target: httpx.URL, is_allowed: AddressFilter) -> IpAddress:
    """The first address the host resolves to, once every one it resolves to is allowed."""
    port = target.port or _DEFAULT_PORTS[target.scheme]
    try:
        answers = socket.getaddrinfo(target.host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise FetchRefused(f"its host `{target.host}` does not resolve ({error})") from None
    addresses = [ipaddress.ip_address(answer[4][0].partition("%")[0]) for answer in answers]
    refused = [address for address in addresses if not is_allowed(address)]
    if refused:
        raise FetchRefused(f"its host `{target.host}` resolves to an address that is not public ({refused[0]})")
    if not addresses:
        raise FetchRefused(f"its host `{target.host}` resolves to no address")
    return addresses[0]


def _host_header(target: httpx.URL) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return host if target.port is None else f"{host}:{target.port}"


def _timeouts(deadline: float) -> dict[str, float]:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise FetchRefused("it took longer than the fetch timeout")
    return {"connect": remaining, "read": remaining, "write": remaining, "pool": remaining}


def _image_body(response: httpx.Response, max_bytes: int, deadline: float) -> FetchedImage:
    if response.status_code != 200:
        raise FetchRefused(f"it answered HTTP {response.status_code}")
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not content_type.startswith("image/"):
        raise FetchRefused(f"its content type is `{content_type or 'missing'}`, not an image type")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise FetchRefused(f"it is {declared} bytes; at most {max_bytes} are allowed")
    chunks, size = [], 0
    try:
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise FetchRefused(f"it is more than {max_bytes} bytes; at most {max_bytes} are allowed")
            if time.monotonic() > deadline:
                raise FetchRefused("it took longer than the fetch timeout")
            chunks.append(chunk)
    except httpx.TimeoutException:
        raise FetchRefused("it took longer than the fetch timeout") from None
    except httpx.HTTPError as error:
        raise FetchRefused(f"it could not be read whole ({type(error).__name__})") from None
    return FetchedImage(b"".join(chunks), content_type)
