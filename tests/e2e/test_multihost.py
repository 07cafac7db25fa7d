"""Many hosts, each a network namespace (tests/e2e/netns.py), with the real SmolLM2, through the
official SDKs: every socket is tcp:// (workers bind every interface and advertise their host's
address), authenticated and encrypted with the cluster's CURVE key, which the control plane generated
and exported; PostgreSQL and Redis are reached over the virtual network, and the KV store's directory
is shared (namespaces share the filesystem).

    control     registry, gateway A      prefill    prefill-0
    decode-a    decode-0                 decode-b   decode-1
    gateway-b   gateway B (finds the workers in the registry's rows only)
    outsider    nothing of the cluster's, and not its key

Proves: streams come through correctly across hosts; a conversation's second turn is served from
blocks a worker on another host wrote; a second gateway serves the same cluster; a tenant's rate
limit holds across both gateways; the outsider gets nothing from a worker's request socket, cannot
deliver KV to its transfer socket, nor register a worker; a decode host's worker killed mid-stream
fails over.
"""

import json
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import psycopg
import pytest
import redis
import zmq
from django.conf import settings

from controlplane.management.commands.serve import GATEWAY_HTTP_OPTIONS
from tests.e2e import netns
from tests.e2e.conftest import ADMIN_URL, MODEL, ROOT, Stack, manage, wait_until_ready
from workers import curve
from workers.protocol.messages import ExpectTransferRequest, GenerateError, StatusRequest, WorkerHeartbeat

pytestmark = pytest.mark.slow

HOSTS = ["control", "prefill", "decode-a", "decode-b", "gateway-b", "outsider"]
WORKERS = {"prefill-0": ("prefill", "prefill"), "decode-0": ("decode-a", "decode"), "decode-1": ("decode-b", "decode")}
REGISTRY_PORT, GATEWAY_PORT = 7000, 8000
REQUEST_PORT, HEARTBEAT_PORT, TRANSFER_PORT = 7100, 7101, 7102  # each host has its own ports
REDIS_DB = 12
BLOCK = 16  # tokens per store block: small, so the blocks a decode worker completes count in turn 2
TIMEOUT_S = 600.0  # generous: a hang fails the test, and a busy 2-core CPU decodes slowly
SYSTEM = " ".join(f"Rule {i}: answer briefly and stay polite." for i in range(1, 9))


@dataclass(frozen=True)
class Cluster:
    network: netns.VirtualNetwork
    gateway_a: Stack
    gateway_b: Stack
    workers: dict[str, object]  # worker id → its process
    host_env: dict[str, str]  # manage.py from the test's own namespace (the host's loopback)
    store: str
    key_file: str  # the cluster's CURVE key, as the control plane exported it
    log_dir: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("multihost")
    database = f"sluice_multihost_{os.getpid()}"
    redis_prefix = f"sluice:e2e-multihost:{uuid.uuid4().hex}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{database}"')
    try:
        with netns.VirtualNetwork(HOSTS) as network:
            yield start_cluster(network, tmp, database, redis_prefix)
    finally:
        client = redis.Redis(db=REDIS_DB)
        for key in client.scan_iter(f"{redis_prefix}*"):
            client.delete(key)
        with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def start_cluster(network: netns.VirtualNetwork, tmp, database: str, redis_prefix: str) -> Cluster:
    postgres, redis_at = network.forward(5432), network.forward(6379)
    address = {name: host.address for name, host in network.hosts.items()}
    host_env = dict(os.environ, DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{database}", PYTHONUNBUFFERED="1")
    manage(host_env, "migrate", "--no-input")
    # The cluster's key, made by the control plane and exported once: the hosts share this filesystem.
    key_file = str(tmp / "cluster.key")
    manage(host_env, "create_data_plane_key")
    manage(host_env, "export_data_plane_key", key_file)
    api_key = manage(host_env, "create_api_key", "--tenant", "multihost").strip().splitlines()[-1]
    manage(
        host_env,
        "shell",
        "-c",
        "from controlplane.topology.services.pools import topology_ensure_local; "
        f"topology_ensure_local(hostname='control', model={MODEL!r}, "
        "pools=[('prefill', 'prefill', 1), ('decode', 'decode', 2)])",
    )
    redis_url = f"redis://{redis_at[0]}:{redis_at[1]}/{REDIS_DB}"
    store = str(tmp / "kvstore")

    def env(host: str, **extra: str) -> dict[str, str]:
        var = tmp / host
        var.mkdir(exist_ok=True)
        return dict(
            os.environ,
            DATABASE_URL=f"postgres://postgres@{postgres[0]}:{postgres[1]}/{database}",
            SLUICE_REDIS_URL=redis_url,
            SLUICE_REDIS_PREFIX=f"{redis_prefix}:gw",
            SLUICE_VAR_DIR=str(var),
            SLUICE_CURVE_KEY_FILE=key_file,
            PYTHONUNBUFFERED="1",
            **extra,
        )

    def start(host: str, name: str, command: list[str], **extra: str):
        return network.start(host, command, env=env(host, **extra), log=open(tmp / f"{name}.log", "w"), cwd=ROOT)

    registry = f"tcp://{address['control']}:{REGISTRY_PORT}"
    start("control", "registry", [*MANAGE, "run_registry", f"--endpoint={registry}"])
    workers, endpoints = {}, []
    for index, (worker_id, (host, role)) in enumerate(WORKERS.items()):
        at = f"tcp://{address[host]}"
        endpoints.append(f"{at}:{REQUEST_PORT}|{at}:{HEARTBEAT_PORT}")
        # Bound on every interface of the host, registered under its address.
        workers[worker_id] = start(
            host,
            worker_id,
            [
                *MANAGE,
                "run_worker",
                f"--role={role}",
                f"--model={MODEL}",
                f"--kv-store={store}",
                f"--kv-store-index={redis_url}?prefix={redis_prefix}:kv",
                f"--kv-block-tokens={BLOCK}",
                f"--worker-id={worker_id}",
                f"--request-endpoint=tcp://*:{REQUEST_PORT}",
                f"--heartbeat-endpoint=tcp://*:{HEARTBEAT_PORT}",
                *([f"--transfer-endpoint=tcp://*:{TRANSFER_PORT}"] if role == "decode" else []),
                f"--advertise-host={address[host]}",
                f"--curve-key-file={key_file}",
                f"--pool={role}",
                f"--registry-endpoint={registry}",
                # One GC per store: the first worker runs it.
                *([] if index == 0 else ["--kv-gc-interval=0"]),
            ],
        )
    gateways = {}
    for host, known in (("control", ",".join(endpoints)), ("gateway-b", "")):
        process = start(
            host,
            f"gateway-{host}",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                f"--host={address[host]}",
                f"--port={GATEWAY_PORT}",
                "--log-level=warning",
                "--no-access-log",
                *GATEWAY_HTTP_OPTIONS,
            ],
            SLUICE_MODELS=MODEL,
            # Gateway A is told the workers; gateway B knows them only from the registry's rows.
            SLUICE_WORKER_ENDPOINTS=known,
            SLUICE_WORKER_DISCOVERY_INTERVAL_S="1",
            SLUICE_KV_STORE_INDEX=f"{redis_url}?prefix={redis_prefix}:kv",
            SLUICE_ALLOWED_HOSTS=address[host],
        )
        gateways[host] = Stack(base_url=f"http://{address[host]}:{GATEWAY_PORT}", api_key=api_key, env=host_env)
        wait_until_ready(gateways[host].base_url, process, timeout=TIMEOUT_S)
        wait_for_workers(gateways[host], len(WORKERS))
    return Cluster(network, gateways["control"], gateways["gateway-b"], workers, host_env, store, key_file, str(tmp))


MANAGE = [sys.executable, str(ROOT / "manage.py")]


def wait_for_workers(gateway: Stack, count: int) -> list[dict]:
    deadline = time.monotonic() + TIMEOUT_S
    while len(workers := httpx.get(f"{gateway.base_url}/healthz", timeout=10).json()["workers"]) < count:
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)
    return workers


def chat(gateway: Stack, messages: list[dict], **options):
    return gateway.openai(timeout=TIMEOUT_S).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, **{"max_tokens": 24, **options}
    )


def registered_instances(cluster: Cluster, state: str = "ready") -> list[dict]:
    script = (
        "import json; from controlplane.topology.models import EngineInstance; "
        f"print(json.dumps(list(EngineInstance.objects.filter(state__in={state.split(',')!r})"
        ".values('worker_id', 'request_endpoint', 'transfer_endpoint', 'node__hostname'))))"
    )
    return json.loads(manage(cluster.host_env, "shell", "-c", script).strip().splitlines()[-1])


def test_workers_register_from_their_hosts_and_both_sdks_stream_across_them(cluster):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = chat(cluster.gateway_a, messages).choices[0].message.content
    chunks = chat(cluster.gateway_a, messages, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with cluster.gateway_a.anthropic(timeout=TIMEOUT_S).messages.stream(
        model=MODEL, max_tokens=24, messages=messages, extra_body={"temperature": 0}
    ) as stream:
        anthropic_text = "".join(stream.text_stream)
        final = stream.get_final_message()

    instances = {i["worker_id"]: i for i in registered_instances(cluster)}
    for worker_id, (host, role) in WORKERS.items():
        at = f"tcp://{cluster.network.hosts[host].address}"
        assert instances[worker_id]["node__hostname"] == host
        assert instances[worker_id]["request_endpoint"] == f"{at}:{REQUEST_PORT}"
        assert instances[worker_id]["transfer_endpoint"] == (f"{at}:{TRANSFER_PORT}" if role == "decode" else "")
    assert whole and streamed == whole
    assert anthropic_text == whole and final.stop_reason in ("end_turn", "max_tokens")


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_second_turn_is_served_from_blocks_a_decode_host_wrote(cluster):
    first = chat(cluster.gateway_a, conversation("Tell me a story about a lighthouse."), max_tokens=48)
    turn2 = [
        *conversation("Tell me a story about a lighthouse."),
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Make it shorter."},
    ]
    # Through the other gateway: it reads the same index, and routes to the same prefill host.
    second = chat(cluster.gateway_b, turn2)

    prompt_blocks = first.usage.prompt_tokens // BLOCK * BLOCK
    assert first.usage.completion_tokens >= 2 * BLOCK
    # The prefill host wrote the first prompt's whole blocks; only the decode host computed the answer,
    # so cached tokens past those come from its blocks, read from the shared directory.
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt_blocks + BLOCK


def test_a_second_gateway_on_its_own_host_serves_the_same_cluster(cluster):
    messages = conversation("What is two plus two?")
    workers = wait_for_workers(cluster.gateway_b, len(WORKERS))
    via_a = chat(cluster.gateway_a, messages).choices[0].message.content
    via_b = chat(cluster.gateway_b, messages).choices[0].message.content

    assert sorted(w["worker_id"] for w in workers) == sorted(WORKERS)
    assert via_b == via_a


@pytest.mark.skipif(
    not hasattr(settings, "SLUICE_REDIS_URL"), reason="rate limits across gateways need SLUICE_REDIS_URL"
)
def test_a_tenants_rate_limit_holds_across_both_gateways(cluster):
    rpm = 2
    key = manage(cluster.host_env, "create_api_key", "--tenant", "limited").strip().splitlines()[-1]
    manage(
        cluster.host_env,
        "shell",
        "-c",
        "from controlplane.tenants.models import Tenant; "
        f"Tenant.objects.filter(name='limited').update(rate_limit_rpm={rpm})",
    )
    started = time.monotonic()
    statuses = []
    for attempt in range(6):
        gateway = cluster.gateway_a if attempt % 2 == 0 else cluster.gateway_b
        response = httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        statuses.append(response.status_code)
    refilled = int((time.monotonic() - started) * rpm / 60)

    assert set(statuses) == {200, 429}, statuses
    # Each gateway alone would allow `rpm`: together they allow it once (plus what refilled meanwhile).
    assert statuses.count(200) <= rpm + refilled, statuses


def decode_heartbeat(cluster: Cluster, key: curve.CurveKey) -> WorkerHeartbeat:
    with zmq.Context() as context, context.socket(zmq.SUB) as subscriber:
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.subscribe(b"")
        curve.connect(subscriber, f"tcp://{cluster.network.hosts['decode-a'].address}:{HEARTBEAT_PORT}", key)
        assert subscriber.poll(TIMEOUT_S * 1000)
        return msgspec.msgpack.decode(subscriber.recv(), type=WorkerHeartbeat)


def test_a_host_without_the_key_gets_no_answer_delivers_no_kv_and_registers_no_worker(cluster):
    # given the decode worker on decode-a, told (by a member holding the key) to expect KV for the
    # requests the outsider will name, for longer than the outsider tries
    key = curve.load_key_file(cluster.key_file)
    decode = f"tcp://{cluster.network.hosts['decode-a'].address}"
    registry = f"tcp://{cluster.network.hosts['control'].address}:{REGISTRY_PORT}"
    ways, probe_seconds = ("plain", "own-keypair", "wrong-key"), 8.0
    before = decode_heartbeat(cluster, key)
    with zmq.Context() as context, context.socket(zmq.DEALER) as member:
        member.setsockopt(zmq.LINGER, 0)
        curve.connect(member, f"{decode}:{REQUEST_PORT}", key)
        expectations = [ExpectTransferRequest(f"forged-{way}", timeout_s=probe_seconds + 20) for way in ways]
        for message in (*expectations, StatusRequest("expecting")):
            member.send(msgspec.msgpack.encode(message))
        assert member.poll(TIMEOUT_S * 1000)
        member.recv()  # the status: the expectations are in place

        # when the outsider tries each way on the worker's request and transfer sockets and the registry
        probe = cluster.network.start(
            "outsider",
            [
                sys.executable, "-m", "tests.e2e.curve_probe",
                f"--request-endpoint={decode}:{REQUEST_PORT}",
                f"--transfer-endpoint={decode}:{TRANSFER_PORT}",
                f"--register-endpoint={registry}",
                f"--cluster-public-key={key.public_key.decode()}",
                "--transfer-request-id=forged",
                f"--seconds={probe_seconds}",
            ],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            log=open(f"{cluster.log_dir}/outsider.log", "w"),
            cwd=ROOT,
        )  # fmt: skip
        assert probe.wait(timeout=TIMEOUT_S) == 0
        settled = {}
        while len(settled) < len(ways):
            assert member.poll(TIMEOUT_S * 1000)
            reply = msgspec.msgpack.decode(member.recv(), type=GenerateError)
            settled[reply.request_id] = reply
    answers = json.loads(Path(cluster.log_dir, "outsider.log").read_text().strip().splitlines()[-1])
    after = decode_heartbeat(cluster, key)
    outsider = cluster.network.hosts["outsider"].address

    # then it heard nothing back, the worker never took its request or its KV, and no row is its worker
    assert answers == {way: {"request": 0, "register": 0} for way in ways}
    assert after.num_prompt_tokens == before.num_prompt_tokens
    for way in ways:
        assert settled[f"forged-{way}"].kind == "transfer_failed"
        assert "no KV arrived" in settled[f"forged-{way}"].message  # not the malformed KV's error
    every_state = "starting,ready,draining,stopped,failed"
    assert not [i for i in registered_instances(cluster, every_state) if i["worker_id"].startswith("outsider")]
    # The own-keypair way got through the handshake to the ZAP handlers, which refused it.
    for log in ("decode-0.log", "registry.log"):
        assert f"refused a CURVE client from {outsider}" in Path(cluster.log_dir, log).read_text()


def stream(gateway: Stack, index: int, progress: list[int]) -> tuple[str, str]:
    chunks = gateway.openai(timeout=TIMEOUT_S).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me a story about the number {index}."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = [], ""
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            progress[index] += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return "".join(text), finish


def test_sigkill_of_a_decode_hosts_worker_mid_stream_fails_over_to_the_other_host(cluster):
    gateway, count = cluster.gateway_a, 4
    reference = [stream(gateway, index, [0] * count) for index in range(count)]
    progress = [0] * count
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(stream, gateway, index, progress) for index in range(count)]
        deadline = time.monotonic() + TIMEOUT_S
        while min(progress) < 2 * BLOCK:
            assert time.monotonic() < deadline, progress
            assert not any(f.done() for f in futures), "a stream ended before the fault"
            time.sleep(0.02)
        running = {w["worker_id"]: w["num_running"] for w in wait_for_workers(gateway, len(WORKERS))}
        victim = max(("decode-0", "decode-1"), key=lambda worker: running.get(worker, -1))
        cluster.workers[victim].send_signal(signal.SIGKILL)
        texts = [future.result(timeout=TIMEOUT_S) for future in futures]

    assert running[victim] >= 1
    assert texts == reference and all(finish == "length" for _, finish in texts)
    assert cluster.workers[victim].wait(timeout=30) == -signal.SIGKILL
    survivors = [w["worker_id"] for w in httpx.get(f"{gateway.base_url}/healthz", timeout=10).json()["workers"]]
    assert victim not in survivors
