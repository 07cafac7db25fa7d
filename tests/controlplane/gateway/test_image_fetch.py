"""Fetching image URLs safely, against real HTTP servers on this machine's loopback addresses.

Loopback is refused by design, so the tests that need an *allowed* server (a fetch that works, a
redirect from an allowed server to a private one, bad content types, sizes, stalls) swap the
address rule for one that also allows 127.0.0.1: the rule is a parameter of the fetch, and nothing
else is replaced (resolution, connection, redirects and streaming are the real ones). The private
servers sit on 127.0.0.2 and ::1, which the swapped rule still refuses, and count their hits.
"""

import http.server
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterator

import deepseek_recipe
import pytest

from recipe.api import ApiError, RequestLimits
from recipe.images.destinations import address_filter, is_public_address
from recipe.images.fetch import MAX_REDIRECTS
from recipe.images.resolve import resolve_images
from tests.controlplane.gateway.helpers import key_headers
from tests.controlplane.gateway.images import body_with_images, image_field, png
from tests.controlplane.gateway.test_hostile_inputs import assert_refused

ALLOWED_SERVER = ipaddress.ip_address("127.0.0.1")
FIELD = "messages[0].content[1].image_url.url"


def also_the_allowed_server(address) -> bool:
    return address == ALLOWED_SERVER or is_public_address(address)


class Server:
    """An HTTP server whose routes are (status, headers, body) or a callable handler; counts hits."""

    def __init__(self, host: str, routes: dict[str, tuple | Callable]) -> None:
        self.hits: list[str] = []
        self.host_headers: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits.append(self.path)
                server.host_headers.append(self.headers["host"])
                route = routes.get(self.path, (404, {}, b""))
                if callable(route):
                    route(self)
                    return
                status, headers, body = route
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        http_server = type("HttpServer", (http.server.ThreadingHTTPServer,), {"address_family": family})
        self._server = http_server((host, 0), Handler)
        self.port = self._server.server_address[1]
        self.host = host
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


IMAGE = png(seed=5)
IMAGE_ROUTE = (200, {"content-type": "image/png", "content-length": str(len(IMAGE))}, IMAGE)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers = []

    def start(host: str, routes: dict) -> Server:
        servers.append(Server(host, routes))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def fetch(url: str, *, is_allowed=is_public_address, **limits):
    if limits.get("image_fetch_allowed_networks"):
        return resolve_images("chat.completions", body_with_images("chat.completions", url), RequestLimits(**limits))
    return resolve_images(
        "chat.completions", body_with_images("chat.completions", url), RequestLimits(**limits), is_allowed=is_allowed
    )


def refused_fetch(url: str, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as refused:
        fetch(url, **kwargs)
    assert refused.value.status == 400 and refused.value.param == FIELD, refused.value
    assert f"`{FIELD}`" in refused.value.message
    return refused.value


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "169.254.169.254",
        "169.254.1.1",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "100.100.100.200",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a00:1",
        "2002:7f00:1::",
    ],
)
def test_private_and_special_addresses_are_refused(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address):
    assert is_public_address(ipaddress.ip_address(address))


def test_an_image_from_an_allowed_server_is_fetched_and_decoded(serve):
    server = serve("127.0.0.1", {"/cat.png": IMAGE_ROUTE})
    (image,) = fetch(server.url("/cat.png"), is_allowed=also_the_allowed_server)
    assert (image.width, image.height, image.data) == (8, 6, IMAGE)
    assert server.hits == ["/cat.png"]


def test_an_operator_allowed_private_network_is_fetched_from_and_nothing_else_is(serve):
    server = serve("127.0.0.1", {"/cat.png": IMAGE_ROUTE})
    (image,) = fetch(server.url("/cat.png"), image_fetch_allowed_networks=("127.0.0.0/8",))
    assert image.data == IMAGE and server.hits == ["/cat.png"]
    refused = refused_fetch("http://10.1.2.3/cat.png", image_fetch_allowed_networks=("127.0.0.0/8",))
    assert "not public" in refused.message


def test_no_allowed_network_opens_a_metadata_address():
    allowed = address_filter(["169.254.0.0/16", "100.64.0.0/10", "10.0.0.0/8"])
    assert allowed(ipaddress.ip_address("169.254.1.1")) and allowed(ipaddress.ip_address("10.9.8.7"))
    for metadata in ("169.254.169.254", "100.100.100.200"):
        assert not allowed(ipaddress.ip_address(metadata))
    assert not allowed(ipaddress.ip_address("192.168.1.1"))
    with pytest.raises(ValueError, match="image_fetch_allowed_networks"):
        RequestLimits(image_fetch_allowed_networks=("10.0.0.0/33",))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_by_address_or_by_name_is_refused_and_never_fetched(serve, host):
    server = serve("127.0.0.1", {"/cat.png": IMAGE_ROUTE})
    error = refused_fetch(f"http://{host}:{server.port}/cat.png")
    assert "not public" in error.message
    assert server.hits == []


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["[::1]", "[::ffff:127.0.0.1]"])
def test_ipv6_loopback_and_ipv4_mapped_loopback_are_refused_and_never_fetched(serve, host):
    server = serve("::1", {"/cat.png": IMAGE_ROUTE})
    refused_fetch(f"http://{host}:{server.port}/cat.png")
    assert server.hits == []


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1/cat.png", "http://169.254.169.254/latest/meta-data/", "https://[fd00:ec2::254]/"]
)
def test_private_and_metadata_addresses_are_refused_before_connecting(url):
    # Nothing listens there on this machine: a connection attempt would say so, the refusal does not.
    assert "not public" in refused_fetch(url).message


def test_a_redirect_from_an_allowed_server_to_a_private_one_is_refused_and_never_followed(serve):
    private = serve("127.0.0.2", {"/secret.png": IMAGE_ROUTE})
    allowed = serve("127.0.0.1", {"/cat.png": (302, {"location": private.url("/secret.png")}, b"")})
    error = refused_fetch(allowed.url("/cat.png"), is_allowed=also_the_allowed_server)
    assert "127.0.0.2" in error.message
    assert allowed.hits == ["/cat.png"] and private.hits == []


def test_a_redirect_target_is_checked_again_by_name(serve):
    # given: a rule that allows the first address checked (the allowed server's) and no other, and a
    # redirect to the private server by a name that resolves to that same address
    private = serve("127.0.0.1", {"/secret.png": IMAGE_ROUTE})
    allowed = serve("127.0.0.1", {"/cat.png": (301, {"location": f"http://localhost:{private.port}/secret.png"}, b"")})
    checked = []

    def first_check_only(address) -> bool:
        checked.append(address)
        return len(checked) == 1

    # when / then
    refused_fetch(allowed.url("/cat.png"), is_allowed=first_check_only)
    assert len(checked) > 1 and allowed.hits == ["/cat.png"] and private.hits == []


def test_an_allowed_redirect_is_followed_and_a_long_chain_is_refused(serve):
    routes = {"/cat.png": IMAGE_ROUTE}
    server = serve("127.0.0.1", routes)
    routes["/moved"] = (307, {"location": "/cat.png"}, b"")
    routes["/loop"] = (302, {"location": "/loop"}, b"")
    assert fetch(server.url("/moved"), is_allowed=also_the_allowed_server)[0].data == IMAGE
    error = refused_fetch(server.url("/loop"), is_allowed=also_the_allowed_server)
    assert f"more than {MAX_REDIRECTS} times" in error.message
    assert server.hits.count("/loop") == MAX_REDIRECTS + 1


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ((200, {"content-type": "text/html"}, b"<html></html>"), "`text/html`, not an image type"),
        ((200, {}, IMAGE), "not an image type"),
        ((404, {"content-type": "image/png"}, b""), "HTTP 404"),
        ((200, {"content-type": "image/png", "content-length": "999999"}, b""), "999999 bytes; at most 1000"),
    ],
    ids=["html", "no-content-type", "not-found", "declared-too-large"],
)
def test_non_images_and_errors_are_refused(serve, route, says):
    server = serve("127.0.0.1", {"/x": route})
    assert says in refused_fetch(server.url("/x"), is_allowed=also_the_allowed_server, max_image_bytes=1000).message


def test_a_body_past_the_bytes_limit_is_abandoned_while_streaming(serve):
    sent = []

    def endless(handler) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "image/png")  # no length: it streams until closed
        handler.end_headers()
        try:
            for _ in range(10_000):
                handler.wfile.write(b"\0" * 4096)
                sent.append(4096)
        except OSError:
            pass

    server = serve("127.0.0.1", {"/big.png": endless})
    error = refused_fetch(server.url("/big.png"), is_allowed=also_the_allowed_server, max_image_bytes=100_000)
    assert "more than 100000 bytes" in error.message
    assert sum(sent) < 10_000 * 4096  # the client stopped reading long before the end


def test_a_stalled_server_is_given_up_at_the_fetch_timeout(serve):
    release = threading.Event()

    def stall(handler) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "image/png")
        handler.end_headers()
        handler.wfile.write(IMAGE[:10])
        handler.wfile.flush()
        release.wait(30)

    server = serve("127.0.0.1", {"/slow.png": stall})
    try:
        error = refused_fetch(server.url("/slow.png"), is_allowed=also_the_allowed_server, image_fetch_timeout_s=1)
    finally:
        release.set()
    assert "fetch timeout" in error.message


def test_the_recipes_fetcher_checks_addresses_but_not_content_types(serve):
    # Why recipe.images.fetch exists: deepseek-recipe's fetcher asks a destination filter (after
    # resolution and on redirects) but returns an HTML page as an image, and has no timeout setting.
    server = serve("127.0.0.1", {"/page": (200, {"content-type": "text/html"}, b"<html></html>")})
    seen = []
    fetcher = deepseek_recipe.ReqwestImageFetcher.with_max_bytes(1000).with_destination_filter(
        lambda host, address: seen.append((host, address)) or address == "127.0.0.1"
    )
    assert fetcher.fetch(f"http://localhost:{server.port}/page") == b"<html></html>"
    assert ("localhost", "127.0.0.1") in seen


@pytest.mark.parametrize("protocol", ["chat.completions", "responses", "messages"])
def test_through_the_gateway_a_private_url_is_the_protocols_400_and_nothing_is_fetched(
    api, make_api_key, serve, protocol
):
    server = serve("127.0.0.1", {"/cat.png": IMAGE_ROUTE})
    headers = key_headers(make_api_key())
    for host in ("127.0.0.1", "localhost"):
        answer = api.post(protocol, body_with_images(protocol, f"http://{host}:{server.port}/cat.png"), headers=headers)
        assert_refused(answer, protocol, image_field(protocol, 0))
        assert "not public" in answer.json()["error"]["message"]
    assert server.hits == []


def test_the_checked_address_is_the_one_connected_to_so_dns_rebinding_reaches_nothing(serve, monkeypatch):
    # given: a name whose DNS answer changes after its first lookup, from the allowed server's address
    # to the private server's (a rebinding attack; the one stand-in here is that DNS answer)
    allowed = serve("127.0.0.1", {"/cat.png": IMAGE_ROUTE})
    private = serve("127.0.0.2", {"/cat.png": IMAGE_ROUTE})
    real_getaddrinfo, lookups = socket.getaddrinfo, []

    def rebinding_dns(host, port, *args, **kwargs):
        if host != "rebind.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        lookups.append(host)
        return real_getaddrinfo("127.0.0.1" if len(lookups) == 1 else "127.0.0.2", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    allowed_route = allowed.url("/cat.png").replace("127.0.0.1", "rebind.test")

    # when
    (image,) = fetch(allowed_route, is_allowed=also_the_allowed_server)

    # then: one lookup, and the image from the checked address; nothing from the other
    assert lookups == ["rebind.test"] and image.data == IMAGE
    assert allowed.hits == ["/cat.png"] and private.hits == []
    assert allowed.host_headers == [f"rebind.test:{allowed.port}"]
