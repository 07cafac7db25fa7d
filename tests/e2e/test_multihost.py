"""Many hosts, each a network namespace (tests/e2e/netns.py), with the real SmolLM2, through the
official SDKs: every socket is tcp:// on a host's own address, PostgreSQL and Redis are reached over
the virtual network, and the KV store's directory is shared (namespaces share the filesystem).

    control     registry, gateway A      prefill    prefill-0
    decode-a    decode-0                 decode-b   decode-1
    gateway-b   gateway B (finds the workers in the registry's rows only)

Proves: streams come through correctly across hosts; a conversation's second turn is served from
blocks a worker on another host wrote; a second gateway serves the same cluster; a tenant's rate
limit holds across both gateways; a decode host's worker killed mid-stream fails over.
"""

import json
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psycopg
import pytest
import redis
from django.conf import settings

from controlplane.management.commands.serve import GATEWAY_HTTP_OPTIONS
from tests.e2e import netns
from tests.e2e.conftest import ADMIN_URL, MODEL, ROOT, Stack, manage, wait_until_ready

pytestmark = pytest.mark.slow

HOSTS = ["control", "prefill", "decode-a", "decode-b", "gateway-b"]
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
                f"--request-endpoint={at}:{REQUEST_PORT}",
                f"--heartbeat-endpoint={at}:{HEARTBEAT_PORT}",
                *([f"--transfer-endpoint={at}:{TRANSFER_PORT}"] if role == "decode" else []),
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
    return Cluster(network, gateways["control"], gateways["gateway-b"], workers, host_env, store)


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


def registered_instances(cluster: Cluster) -> list[dict]:
    script = (
        "import json; from controlplane.topology.models import EngineInstance; "
        "print(json.dumps(list(EngineInstance.objects.filter(state='ready')"
        ".values('worker_id', 'request_endpoint', 'node__hostname'))))"
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
    for worker_id, (host, _) in WORKERS.items():
        assert instances[worker_id]["node__hostname"] == host
        assert instances[worker_id]["request_endpoint"] == f"tcp://{cluster.network.hosts[host].address}:{REQUEST_PORT}"
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
