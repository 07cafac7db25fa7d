"""Hosts in Linux network namespaces, for multi-host tests and benchmarks on one machine.

`VirtualNetwork(["control", "prefill", ...])` creates one namespace per host (its own loopback, its
own ports, its own hostname through a UTS namespace per process), all on a private /24 behind one
bridge in the host namespace, which holds the first address. The namespaces share the filesystem,
so a temp directory is a shared mount (the KV store's directory) for free.

PostgreSQL and Redis listen on 127.0.0.1 of the host namespace only; `forward()` reaches them from
the namespaces without reconfiguring them: a TCP forwarder (asyncio, on a thread of this process)
listens on the bridge address and connects to the service on the host's loopback.

Everything is removed on exit, whatever happened: the processes started in the namespaces, the
forwarders, the namespaces (their veth ends go with them) and the bridge. Names carry the creating
process's id, so a network whose creator was killed (SIGKILL of pytest) is removed by the next one.
"""

import asyncio
import ipaddress
import os
import random
import re
import secrets
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PREFIX = "sluice-"  # of every namespace this module creates: "sluice-<run>-<host>"
STOP_GRACE_S = 10.0
# Runs the command as the host: its own UTS namespace named after the host (workers register under
# their hostname), then exec, so the process's id is the command's.
_AS_HOST = 'hostname "$0" && exec "$@"'


def unavailable_reason() -> str | None:
    """Why this machine cannot run namespaced hosts (not root, no `ip`, no permission), else None."""
    probe = f"{PREFIX}probe{os.getpid():x}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        return "`ip` (iproute2) is not installed"
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` is not permitted here: {error.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # also its hostname
    namespace: str
    address: str

    def argv(self, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", _AS_HOST, self.name, *command]


class VirtualNetwork:
    def __init__(self, hosts: Sequence[str]) -> None:
        if len(set(hosts)) != len(hosts) or not all(re.fullmatch(r"[a-z][a-z0-9-]{0,20}", h) for h in hosts):
            raise ValueError(f"host names must be distinct, lowercase and short, got {list(hosts)}")
        self.run = f"{os.getpid():x}{secrets.token_hex(1)}"
        self.bridge = f"slb{self.run}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.address = str(addresses[0])  # the bridge's, in the host namespace
        self.hosts = {
            name: Host(name=name, namespace=f"{PREFIX}{self.run}-{name}", address=str(addresses[i + 1]))
            for i, name in enumerate(hosts)
        }
        self.processes: list[subprocess.Popen] = []
        self.forwarders: list[Forwarder] = []

    def __enter__(self) -> "VirtualNetwork":
        remove_stale_networks()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, host in enumerate(self.hosts.values()):
                veth = f"slv{self.run}{index}"
                _ip("netns", "add", host.namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
                _ip("link", "set", veth, "master", self.bridge, "up")
                inside = ("ip", "netns", "exec", host.namespace, "ip")
                _run(*inside, "link", "set", "lo", "up")
                _run(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
                _run(*inside, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def forward(self, port: int, target: tuple[str, int] | None = None) -> tuple[str, int]:
        """(address, port) in the namespaces where 127.0.0.1:`port` of the host namespace answers (or
        `target`): the bridge's address and a port the system chose."""
        forwarder = Forwarder((self.address, 0), target or ("127.0.0.1", port))
        forwarder.start()
        self.forwarders.append(forwarder)
        return forwarder.listening

    def start(
        self, host: str, command: Sequence[str], *, env: dict[str, str], log: IO, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Run `command` on `host`, in a session of its own; stopped on exit if still running. The
        process's id is the command's (nothing forks in between), so a signal to it reaches the command."""
        process = subprocess.Popen(
            self.hosts[host].argv(command),
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            _signal_group(process, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for forwarder in self.forwarders:
            forwarder.stop()
        for host in self.hosts.values():
            _remove_namespace(host.namespace)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def remove_stale_networks() -> None:
    """Remove the namespaces and bridges of networks whose creating process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for run in {m.group(1) for name in listed if (m := re.fullmatch(rf"{PREFIX}([0-9a-f]+)-[a-z0-9-]+", name))}:
        if Path(f"/proc/{int(run[:-2], 16)}").exists():
            continue
        for name in listed:
            if name.startswith(f"{PREFIX}{run}-"):
                _remove_namespace(name)
        subprocess.run(["ip", "link", "del", f"slb{run}"], capture_output=True)


class Forwarder:
    """Accepts TCP connections on `listen` and pipes each, both ways, to a new connection to `target`."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._pipe, *listen))
        self.listening: tuple[str, int] = self.server.sockets[0].getsockname()[:2]
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"forward-{target[1]}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.server.close()
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_copy(reader, target_writer), _copy(target_reader, writer))


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface of this machine is on (another network of ours included)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    taken = [ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", used)]
    while True:
        subnet = ipaddress.ip_network(f"10.{random.randint(200, 254)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _remove_namespace(namespace: str) -> None:
    """Kill what still runs in the namespace (processes of ours: we made it), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*argv: str) -> None:
    completed = subprocess.run(argv, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {completed.stderr.strip()}")
