"""Real worker processes with the cluster's CURVE key on loopback tcp://, registering with a
RegistryServer that holds it too: members are served end to end (prefill to decode over a CURVE KV
transfer), clients without the key get nothing from a worker's request, heartbeat or transfer socket,
a worker with another key never registers, and a bad key file or an unkeyed network endpoint stops a
worker at start with one line."""

import asyncio
import subprocess
import threading

import msgspec
import pytest
import zmq

from tests.waiting import wait_until
from tests.workers.worker.test_registry import Recorder
from tests.workers.worker_process import (
    REPO_ROOT,
    STARTUP_TIMEOUT_S,
    Dealer,
    WorkerProcess,
    collect,
    start_worker,
    token_ids,
    wait_for_heartbeat,
    worker_command,
)
from workers import curve
from workers.client.engine_client import EngineClient
from workers.curve import CurveKey, generate_key
from workers.engine import SamplingParams
from workers.protocol.messages import (
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    StatusRequest,
    WorkerHeartbeat,
    WorkerRegistration,
)
from workers.worker.registry import REGISTRATION_RETRY_S, RegistryServer

MODEL = "tiny"  # every worker serves the same model name, so KV computed by one fits the others
KEY = generate_key(1)
OTHER = generate_key(1)  # another cluster's key: a host that does not belong here
LOOPBACK = "tcp://127.0.0.1:0"  # the system picks the port; workers register the one it chose


class KeyedDealer(Dealer):
    """tests.workers.worker_process.Dealer connected through workers.curve with `key`."""

    def __init__(self, request_endpoint: str, key: CurveKey | None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        curve.connect(self.socket, request_endpoint, key)


def heartbeat(endpoint: str, key: CurveKey | None, *, count: int = 1, timeout_s: float = 0.0) -> WorkerHeartbeat | None:
    """The `count`th heartbeat a subscriber with `key` hears from `endpoint` (None if none within
    `timeout_s`; 0: wait up to the startup timeout)."""
    with zmq.Context() as context, context.socket(zmq.SUB) as subscriber:
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.subscribe(b"")
        curve.connect(subscriber, endpoint, key)
        last = None
        for _ in range(count):
            if not subscriber.poll((timeout_s or STARTUP_TIMEOUT_S) * 1000):
                return None
            last = msgspec.msgpack.decode(subscriber.recv(), type=WorkerHeartbeat)
        return last


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A registry, a prefill worker on 127.0.0.1 and a decode worker bound to every interface that
    advertises 127.0.0.1, all with KEY; and an intruder worker with OTHER, started with them."""
    directory = tmp_path_factory.mktemp("curve")
    key_file, other_file = directory / "cluster.key", directory / "other.key"
    curve.write_key_file(key_file, KEY)
    curve.write_key_file(other_file, OTHER)
    recorder = Recorder()
    context = zmq.Context()
    registry = RegistryServer(
        LOOPBACK,
        on_register=recorder.on_register,
        on_heartbeat=recorder.heartbeats.append,
        on_silence=recorder.silences.append,
        context=context,
        key=KEY,
    )
    registry.start()
    common = ["--registry-endpoint", registry.bound_endpoint, "--heartbeat-endpoint", LOOPBACK]
    workers: dict[str, WorkerProcess] = {
        "p": start_worker(
            directory, "p", *common, "--role", "prefill", "--request-endpoint", LOOPBACK,
            "--curve-key-file", str(key_file), model=MODEL,
        ),
        "d": start_worker(
            directory, "d", "--registry-endpoint", registry.bound_endpoint, "--role", "decode",
            "--request-endpoint", "tcp://*:0", "--heartbeat-endpoint", "tcp://*:0", "--transfer-endpoint",
            "tcp://*:0", "--advertise-host", "127.0.0.1", "--transfer-timeout", "60",
            "--curve-key-file", str(key_file), model=MODEL,
        ),
        # Its heartbeats stay on the default ipc:// endpoint (plain), where the test reads them.
        "intruder": start_worker(
            directory, "intruder", "--registry-endpoint", registry.bound_endpoint, "--role", "prefill",
            "--request-endpoint", LOOPBACK, "--curve-key-file", str(other_file), model=MODEL,
        ),
    }  # fmt: skip
    try:
        wait_until(lambda: {r.worker_id for r in recorder.registrations} >= {"p", "d"}, timeout_s=STARTUP_TIMEOUT_S)
        yield {r.worker_id: r for r in recorder.registrations}, recorder, workers
    finally:
        stopped = {name: worker.stop() for name, worker in workers.items()}
        registry.stop()
        context.term()
        assert stopped == {"p": 0, "d": 0, "intruder": 0}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_split_request_runs_end_to_end_over_curve_and_wildcard_binds_are_advertised(cluster):
    registrations, _, _ = cluster
    prefill, decode = registrations["p"], registrations["d"]

    async def go():
        client = EngineClient(key=KEY, heartbeat_timeout_s=30.0)
        for worker in (prefill, decode):
            client.add_worker(worker.request_endpoint, worker.heartbeat_endpoint)
        await client.start()
        try:
            await wait_for_heartbeat(client, lambda beats: len(beats) == 2, timeout_s=STARTUP_TIMEOUT_S)
            return await collect(client, GenerateRequest("split", [5, 6, 7, 8], greedy(6)))
        finally:
            await client.close()

    outputs = asyncio.run(go())

    assert len(token_ids(outputs)) == 6 and outputs[-1].finish_reason == "length"
    for endpoint in (decode.request_endpoint, decode.heartbeat_endpoint, decode.transfer_endpoint):
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")


def test_a_client_without_the_key_gets_no_answer_and_its_request_never_reaches_the_engine(cluster):
    registrations, _, _ = cluster
    decode = registrations["d"]
    before = heartbeat(decode.heartbeat_endpoint, KEY)
    intruders = [KeyedDealer(decode.request_endpoint, key) for key in (None, OTHER)]
    prompt = list(range(1, 40))

    for index, intruder in enumerate(intruders):
        intruder.send(GenerateRequest(f"intruder-{index}", prompt, greedy(4)))
    with KeyedDealer(decode.request_endpoint, KEY) as member:
        member.send(GenerateRequest("member", [9, 10, 11], greedy(4)))
        outputs = [member.receive()]
        while not (isinstance(outputs[-1], GenerateOutput) and outputs[-1].finish_reason):
            outputs.append(member.receive())
    after = heartbeat(decode.heartbeat_endpoint, KEY, count=3)  # past the step that finished the member

    assert all(isinstance(output, GenerateOutput) for output in outputs)
    assert after.num_prompt_tokens - before.num_prompt_tokens == 3  # the member's prompt, no intruder's
    assert not any(intruder.socket.poll(0) for intruder in intruders)
    for intruder in intruders:
        intruder.close()


def test_a_subscriber_without_the_key_hears_no_heartbeat(cluster):
    registrations, _, _ = cluster
    endpoint = registrations["p"].heartbeat_endpoint
    heard: dict[str, WorkerHeartbeat | None] = {}

    def listen(name: str, key: CurveKey | None) -> None:
        heard[name] = heartbeat(endpoint, key, timeout_s=3.0)

    # Meanwhile a member hears ten heartbeats (one every 0.1 s): the intruders had as long.
    intruders = [threading.Thread(target=listen, args=(name, key)) for name, key in (("none", None), ("other", OTHER))]
    for thread in intruders:
        thread.start()
    member = heartbeat(endpoint, KEY, count=10)
    for thread in intruders:
        thread.join()

    assert member is not None and member.worker_id == "p"
    assert heard == {"none": None, "other": None}


def transfer_outcome(decode: WorkerRegistration, request_id: str, key: CurveKey | None) -> GenerateError:
    """Tell the decode worker to expect `request_id` for 3 s, then send it a KV transfer message from a
    DEALER holding `key`: the GenerateError that settles the expectation."""
    malformed = msgspec.msgpack.encode(  # whole but for its dtype: a worker that reads it fails the request
        {"type": "kv_header", "request_id": request_id, "prompt_token_ids": [1], "output_token_ids": [2]}
        | {"params": {}, "num_computed_tokens": 1, "num_cached_tokens": 0, "traffic_class": "chat"}
        | {"cache_namespace": "", "kv_model_id": "x", "dtype": "int8", "kv_layout": "x", "layer_shape": [2, 1, 1, 1]}
        | {"num_layers": 1, "chunk_layers": 1}
    )
    with KeyedDealer(decode.request_endpoint, KEY) as dealer, zmq.Context() as context:
        dealer.send(ExpectTransferRequest(request_id, timeout_s=3.0), StatusRequest(f"status-{request_id}"))
        dealer.receive()  # the status: the expectation is in place
        with context.socket(zmq.DEALER) as sender:
            sender.setsockopt(zmq.LINGER, 0)
            curve.connect(sender, decode.transfer_endpoint, key)
            sender.send_multipart([malformed, b"\x00" * 4])
            reply = dealer.receive()
    assert isinstance(reply, GenerateError) and reply.request_id == request_id
    return reply


def test_a_kv_transfer_from_a_sender_without_the_key_never_reaches_the_decode_worker(cluster):
    registrations, _, _ = cluster

    delivered = transfer_outcome(registrations["d"], "from-member", KEY)
    ignored = [transfer_outcome(registrations["d"], f"from-intruder-{i}", k) for i, k in enumerate((None, OTHER))]

    assert delivered.kind == "transfer_failed" and "no KV arrived" not in delivered.message  # it was read
    assert [(e.kind, "no KV arrived" in e.message) for e in ignored] == [("transfer_failed", True)] * 2


def test_a_worker_with_another_key_is_never_acknowledged_by_the_registry(cluster):
    _, recorder, workers = cluster
    intruder = workers["intruder"]

    # It started with the members, who registered long ago; wait until it has also been serving, and
    # so retrying its registration, for two of its retry intervals.
    def serving_for() -> float:
        beat = heartbeat(intruder.endpoints[1], None)
        return beat.sent_at - beat.started_at

    wait_until(lambda: serving_for() > 2 * REGISTRATION_RETRY_S, timeout_s=STARTUP_TIMEOUT_S)

    assert "intruder" not in {r.worker_id for r in recorder.registrations}
    assert {r.worker_id for r in recorder.registrations} >= {"p", "d"}
    assert intruder.process.poll() is None


@pytest.mark.parametrize(
    "options, says",
    [
        (["--curve-key-file", "{directory}/garbage.key"], "{directory}/garbage.key: not text"),
        (["--curve-key-file", "{directory}/missing.key"], "{directory}/missing.key: cannot be read"),
        (["--request-endpoint", "tcp://*:0"], "refusing tcp://*:0 without the cluster's CURVE key"),
    ],
    ids=["garbage-key-file", "missing-key-file", "network-endpoint-without-key"],
)
def test_a_bad_key_file_or_a_network_endpoint_without_a_key_stops_the_worker_at_start(tmp_path, options, says):
    (tmp_path / "garbage.key").write_bytes(b"\xff\xfe not a key")
    command = worker_command(tmp_path, "w", *(option.format(directory=tmp_path) for option in options))

    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)

    assert completed.returncode == 1
    last_line = completed.stderr.strip().splitlines()[-1]
    assert says.format(directory=tmp_path) in last_line and "Traceback" not in completed.stderr
