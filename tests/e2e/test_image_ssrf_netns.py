"""Image URLs against the real address rule, with a public server that is really public: SSRF by
redirect and by DNS, refused with the protocol's 400 naming the field, nothing fetched.

tests/controlplane/gateway/test_image_fetch.py has to swap the address rule to let a loopback server
play the public one. Here nothing is swapped: two network namespaces (tests/e2e/netns.py) stand in
for the internet. The "public" host holds a global unicast address (PUBLIC_ADDRESS, reached only
from the "gateway" namespace through an on-link route: no route of the machine's own namespace
changes) and serves an image and redirects. The gateway namespace runs the fetch
(tests/e2e/image_fetch_probe.py, recipe.images.resolve_images with the real rule) beside a counting
server on every one of its addresses: its loopback, its 10.x address and 169.254.169.254 on its
loopback (the metadata address). Names resolve through the gateway namespace's own hosts file
(/etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts): `public.example` to the
public address, `private.test` to the gateway's 10.x one. Each case first shows the public server is
reachable and allowed (an image from it is fetched), so a refusal is the rule's, not the network's.
"""

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from recipe.images.destinations import is_public_address
from tests.e2e import netns

pytestmark = pytest.mark.skipif(bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "")

ROOT = Path(__file__).resolve().parents[2]
# Global unicast (APNIC's, next to the documentation range 203.0.113.0/24, which is not global):
# held by the public namespace only, so nothing outside the two namespaces is ever sent to it.
PUBLIC_ADDRESS = "203.0.114.10"
METADATA_ADDRESS = "169.254.169.254"
PUBLIC_PORT = 80
PRIVATE_PORT = 8081  # the gateway namespace's counting server: a fresh namespace has every port free
FIELD = "messages[0].content[1].image_url.url"


@dataclass(frozen=True)
class Internet:
    gateway: netns.Host
    public_log: Path

    def fetch(self, url: str) -> dict:
        """What the gateway's preparation does with a body holding `url`, run in its namespace."""
        command = [sys.executable, "-m", "tests.e2e.image_fetch_probe", "fetch", "--url", url]
        completed = subprocess.run(
            self.gateway.argv([*command, "--private-port", str(PRIVATE_PORT)]),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert completed.returncode == 0, completed.stderr
        return json.loads(completed.stdout.strip().splitlines()[-1])

    def public_hits(self) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.public_log.read_text().splitlines() if line.startswith("hit ")]


def public_url(path: str) -> str:
    return f"http://{PUBLIC_ADDRESS}{path}"


def redirect_to(target: str) -> str:
    return public_url("/redirect?" + urllib.parse.urlencode({"to": target}))


def inside(host: netns.Host, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", host.namespace, *argv], check=True, capture_output=True)


@pytest.fixture(scope="module")
def internet(tmp_path_factory) -> Iterator[Internet]:
    assert is_public_address(ipaddress.ip_address(PUBLIC_ADDRESS))  # the premise: the rule allows it
    log = tmp_path_factory.mktemp("public") / "public.log"
    network = netns.VirtualNetwork(["gateway", "public"])
    with network:
        gateway, public = network.hosts["gateway"], network.hosts["public"]
        inside(public, "ip", "addr", "add", f"{PUBLIC_ADDRESS}/32", "dev", "eth0")
        inside(gateway, "ip", "route", "add", f"{PUBLIC_ADDRESS}/32", "dev", "eth0")
        inside(gateway, "ip", "addr", "add", f"{METADATA_ADDRESS}/32", "dev", "lo")
        hosts_dir = Path("/etc/netns") / gateway.namespace
        hosts_dir.mkdir(parents=True)
        try:
            (hosts_dir / "hosts").write_text(
                f"127.0.0.1 localhost\n{PUBLIC_ADDRESS} public.example\n{gateway.address} private.test\n"
            )
            server = [sys.executable, "-m", "tests.e2e.image_fetch_probe", "serve", "--bind", PUBLIC_ADDRESS]
            with open(log, "w") as public_log:
                network.start(
                    "public", [*server, "--port", str(PUBLIC_PORT)], env=dict(os.environ), log=public_log, cwd=ROOT
                )
            deadline = time.monotonic() + 30
            while "ready" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            yield Internet(gateway=gateway, public_log=log)
        finally:
            shutil.rmtree(hosts_dir, ignore_errors=True)
            try:
                hosts_dir.parent.rmdir()  # /etc/netns, when no other namespace has files there
            except OSError:
                pass


def assert_refused(outcome: dict, *words: str) -> None:
    assert "refused" in outcome, outcome
    refusal = outcome["refused"]
    assert refusal["status"] == 400 and refusal["param"] == FIELD, refusal
    assert f"`{FIELD}`" in refusal["message"] and "not public" in refusal["message"], refusal
    for word in words:
        assert word in refusal["message"], refusal


def test_an_image_on_the_public_server_is_fetched_by_address_and_by_name(internet):
    assert internet.fetch(public_url("/cat.png")) == {"fetched": {"width": 8, "height": 6}, "private_hits": []}
    assert internet.fetch("http://public.example/cat.png")["fetched"] == {"width": 8, "height": 6}


@pytest.mark.parametrize(
    "private_host",
    ["127.0.0.1", "gateway", METADATA_ADDRESS, "private.test", "localhost"],
    ids=["loopback", "ten-slash-eight", "metadata", "name-of-a-private-address", "localhost"],
)
def test_a_redirect_from_the_public_server_to_a_private_one_is_refused_and_never_followed(internet, private_host):
    host = internet.gateway.address if private_host == "gateway" else private_host
    address = {"private.test": internet.gateway.address, "localhost": "127.0.0.1"}.get(host, host)
    before = len(internet.public_hits())

    outcome = internet.fetch(redirect_to(f"http://{host}:{PRIVATE_PORT}/secret.png"))

    assert_refused(outcome, address)
    assert outcome["private_hits"] == []
    # The public hop was really made (with the real rule), and only once: the refusal is the redirect's.
    assert internet.public_hits()[before:] == [f"/redirect?to=http%3A%2F%2F{host}%3A{PRIVATE_PORT}%2Fsecret.png"]


def test_the_private_server_counts_what_reaches_it(internet):
    """The counter the refusals rely on: a fetch that does reach the private server is seen."""
    completed = subprocess.run(
        internet.gateway.argv(
            [
                sys.executable,
                "-c",
                "import threading, urllib.request, time\n"
                "from tests.e2e.image_fetch_probe import start_server\n"
                "hits = []\n"
                f"start_server('0.0.0.0', {PRIVATE_PORT}, hits, redirects=False)\n"
                f"urllib.request.urlopen('http://private.test:{PRIVATE_PORT}/secret.png').read()\n"
                "print(hits)",
            ]
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "['/secret.png']"


def test_a_name_that_resolves_to_a_private_address_is_refused_before_connecting(internet):
    outcome = internet.fetch(f"http://private.test:{PRIVATE_PORT}/secret.png")

    assert_refused(outcome, "private.test", internet.gateway.address)
    assert outcome["private_hits"] == []
