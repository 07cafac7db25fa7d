"""The namespaced-hosts harness itself (tests/e2e/netns.py), without the model: hosts reach each
other and, through the forwarder, the host's Redis; a process runs as its host, under its own id;
everything is gone after the network closes, a dead creator's network is removed by the next one."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.e2e import netns

pytestmark = pytest.mark.skipif(bool(netns.unavailable_reason()), reason=netns.unavailable_reason() or "")


def run_on(host: netns.Host, code: str) -> str:
    completed = subprocess.run(host.argv([sys.executable, "-c", code]), capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_reach_each_other_and_the_hosts_redis_and_everything_goes_on_close(tmp_path):
    network = netns.VirtualNetwork(["one", "two"])
    with network:
        one, two = network.hosts["one"], network.hosts["two"]
        address, port = network.forward(6379)
        key = f"sluice:test-netns:{os.getpid()}"
        redis.Redis(db=12).set(key, "from the host")
        seen = run_on(
            one, f"import redis; print(redis.Redis(host={address!r}, port={port}, db=12).get({key!r}).decode())"
        )
        redis.Redis(db=12).delete(key)
        server = network.start(
            "two",
            [sys.executable, "-m", "http.server", "--bind", two.address, "8080"],
            env=dict(os.environ),
            log=open(tmp_path / "http.log", "w"),
            cwd=tmp_path,
        )
        (tmp_path / "page").write_text("served on two")
        code = f"import urllib.request; print(urllib.request.urlopen('http://{two.address}:8080/page').read().decode())"
        deadline = time.monotonic() + 30
        while (
            page := subprocess.run(one.argv([sys.executable, "-c", code]), capture_output=True, text=True)
        ).returncode:
            assert time.monotonic() < deadline, page.stderr
            time.sleep(0.2)
        hostname = run_on(two, "import socket; print(socket.gethostname())")
        command = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        loopback_elsewhere = subprocess.run(
            one.argv([sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 6379), 2)"]),
            capture_output=True,
        )

    assert seen == "from the host"
    assert page.stdout.strip() == "served on two"
    assert hostname == "two" and command[:3] == [sys.executable.encode(), b"-m", b"http.server"]
    # A namespace has a loopback of its own: the host's Redis is only reachable through the forwarder.
    assert loopback_elsewhere.returncode != 0
    assert server.poll() is not None
    assert all(host.namespace not in namespaces() for host in network.hosts.values())
    assert network.bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_a_network_whose_creator_died_is_removed_by_the_next_one():
    # The creator is a child process that sets a network up and is killed before it can close it.
    code = (
        "import os, signal; from tests.e2e.netns import VirtualNetwork; net = VirtualNetwork(['orphan']); "
        "net.__enter__(); print(net.hosts['orphan'].namespace, net.bridge, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    root = Path(__file__).resolve().parents[2]
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    namespace, bridge = orphan.stdout.split()
    left = namespace in namespaces()
    netns.remove_stale_networks()

    assert left
    assert namespace not in namespaces()
    assert bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_bad_host_names_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        netns.VirtualNetwork(["a", "a"])
    with pytest.raises(ValueError, match="lowercase"):
        netns.VirtualNetwork(["Has Space"])
