"""workers.curve over real ZMQ sockets: who gets through a CURVE server (on loopback tcp, where keys
are optional, so every test gives them explicitly), the endpoint rule, and the key file."""

import os
import stat
import threading

import pytest
import torch
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from tests.waiting import wait_until
from workers import curve
from workers.curve import CurveError, CurveKey, generate_key
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.sampling_params import SamplingParams
from workers.transfer.link import TransferReceiver, TransferSender

KEY = generate_key(1)
OTHER = generate_key(1)  # another cluster's keypair
# Someone who read the cluster's public key somewhere but has no secret for it.
PUBLIC_ONLY = CurveKey(version=1, public_key=KEY.public_key, secret_key=OTHER.secret_key)
INTRUDERS = [None, OTHER, PUBLIC_ONLY, "own keypair"]
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@pytest.fixture
def context():
    with zmq.Context() as context:
        yield context


def bound(context: zmq.Context, kind: int, key: CurveKey | None) -> tuple[zmq.Socket, str]:
    socket = context.socket(kind)
    socket.linger = 0
    curve.bind(socket, "tcp://127.0.0.1:0", key)
    return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)


def connected(context: zmq.Context, kind: int, endpoint: str, key: CurveKey | str | None) -> zmq.Socket:
    """A client through workers.curve with `key`, or, for "own keypair", one that knows the server's
    public key and presents a keypair of its own (the handshake completes; the ZAP handler refuses)."""
    socket = context.socket(kind)
    socket.linger = 0
    socket.reconnect_ivl = 600_000  # one handshake each: a refused client does not try again here
    if kind == zmq.SUB:
        socket.subscribe(b"")
    if key == "own keypair":
        socket.curve_publickey, socket.curve_secretkey = OTHER.public_key, OTHER.secret_key
        socket.curve_serverkey = KEY.public_key
        socket.connect(endpoint)
    else:
        curve.connect(socket, endpoint, key)
    return socket


class HandshakeFailures:
    """Counts the handshakes a server socket refused, from its monitor."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.monitor = socket.get_monitor_socket(HANDSHAKE_FAILED)
        self.count = 0

    def at_least(self, count: int) -> bool:
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)
            self.count += 1
        return self.count >= count


def test_only_a_client_holding_the_cluster_key_reaches_a_curve_router(context):
    router, endpoint = bound(context, zmq.ROUTER, KEY)
    failures = HandshakeFailures(router)
    intruders = [connected(context, zmq.DEALER, endpoint, key) for key in INTRUDERS]
    member = connected(context, zmq.DEALER, endpoint, KEY)

    for intruder in intruders:
        intruder.send(b"intruder")
    member.send(b"member")
    wait_until(lambda: failures.at_least(len(intruders)), timeout_s=30, interval_s=0.02)
    assert router.poll(30_000)
    peer, received = router.recv_multipart()
    router.send_multipart([peer, b"answer"])

    assert received == b"member"
    assert not router.poll(0)  # nothing from the intruders ever reached the server
    assert member.poll(30_000) and member.recv() == b"answer"
    assert not any(intruder.poll(0) for intruder in intruders)


def test_a_subscriber_without_the_cluster_key_hears_no_heartbeat(context):
    publisher, endpoint = bound(context, zmq.PUB, KEY)
    failures = HandshakeFailures(publisher)
    intruders = [connected(context, zmq.SUB, endpoint, key) for key in INTRUDERS]
    member = connected(context, zmq.SUB, endpoint, KEY)

    heard = 0
    while heard < 3:  # a PUB drops messages for subscribers still connecting: publish until heard
        publisher.send(b"heartbeat")
        if member.poll(20):
            member.recv()
            heard += 1
    wait_until(lambda: failures.at_least(len(intruders)), timeout_s=30, interval_s=0.02)
    publisher.send(b"heartbeat")

    assert member.poll(30_000)
    assert not any(intruder.poll(0) for intruder in intruders)


def handoff(request_id: str) -> KVHandoff:
    return KVHandoff(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4],
        params=SamplingParams(max_tokens=2),
        num_computed_tokens=3,
        num_cached_tokens=0,
        traffic_class="chat",
        cache_namespace="",
        kv_model_id="tiny",
        kv_dtype=torch.float32,
        kv_layout="full attention of layers 0-1: 1 KV heads of 4 (float32)",
        token_shape=(2, 1, 4),
        num_layers=2,
        layers=[torch.arange(24, dtype=torch.float32).reshape(2, 1, 3, 4) for _ in range(2)],
    )


def sent(sender: TransferSender) -> str:
    results = []
    wait_until(lambda: results.extend(sender.take_results()) or results, timeout_s=30, interval_s=0.02)
    return results[0].error


def test_a_kv_transfer_from_a_sender_with_another_key_never_reaches_the_decode_router(context):
    router, endpoint = bound(context, zmq.ROUTER, KEY)
    receiver = TransferReceiver(router, default_timeout_s=60)
    receiver.expect("forged", b"", None)
    receiver.expect("real", b"", None)
    intruder = TransferSender(context, key=OTHER, send_timeout_ms=500)
    member = TransferSender(context, key=KEY)
    try:
        intruder.submit("forged", endpoint, handoff("forged"))
        refused = sent(intruder)
        member.submit("real", endpoint, handoff("real"))
        delivered = sent(member)
        settled = []
        wait_until(lambda: settled.extend(receiver.receive(16)) or settled, timeout_s=30, interval_s=0.02)
    finally:
        intruder.close()
        member.close()

    assert "took no message" in refused
    assert delivered == ""
    assert [(s.request_id, s.error) for s in settled] == [("real", "")]
    assert torch.equal(settled[0].handoff.layers[1], handoff("real").layers[1])
    assert "forged" in receiver.expected and not receiver.receive(16)


def test_ipc_stays_plain_with_a_key_and_one_subscriber_follows_curve_and_plain_publishers(context, tmp_path):
    secured, tcp = bound(context, zmq.PUB, KEY)
    local = context.socket(zmq.PUB)
    curve.bind(local, f"ipc://{tmp_path}/hb", KEY)
    plain_client = connected(context, zmq.SUB, f"ipc://{tmp_path}/hb", None)
    subscriber = connected(context, zmq.SUB, tcp, KEY)
    curve.connect(subscriber, f"ipc://{tmp_path}/hb", KEY)

    heard: set[bytes] = set()
    while heard != {b"tcp", b"ipc"}:
        secured.send(b"tcp")
        local.send(b"ipc")
        while subscriber.poll(20):
            heard.add(subscriber.recv())
    local.send(b"ipc")

    assert local.mechanism == zmq.NULL and secured.mechanism == zmq.CURVE
    assert plain_client.poll(30_000) and plain_client.recv() == b"ipc"
    local.close(linger=0)


@pytest.mark.parametrize(
    "endpoint", ["tcp://10.0.0.1:7100", "tcp://*:7100", "tcp://0.0.0.0:7100", "tcp://decode-0:7100", "tcp://[::]:1"]
)
def test_a_network_endpoint_without_a_key_is_refused_with_how_to_get_one(endpoint):
    with pytest.raises(CurveError) as refused:
        curve.uses_curve(endpoint, None)

    assert endpoint in str(refused.value) and "create_data_plane_key" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert curve.uses_curve(endpoint, KEY)


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:7100", "tcp://127.0.0.2:7100", "tcp://localhost:1", "tcp://[::1]:1"]
)
def test_loopback_tcp_is_plain_without_a_key_and_curve_with_one(endpoint):
    assert not curve.uses_curve(endpoint, None)
    assert curve.uses_curve(endpoint, KEY)


@pytest.mark.parametrize("endpoint", ["ipc:///run/sluice/w.req", "inproc://results"])
def test_local_endpoints_are_never_curve(endpoint):
    assert not curve.uses_curve(endpoint, None) and not curve.uses_curve(endpoint, KEY)


def test_a_key_file_is_written_mode_0600_read_back_and_readable_by_zmq_auth(tmp_path):
    path = tmp_path / "cluster.key"
    key = generate_key(7)

    curve.write_key_file(path, key)

    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert curve.load_key_file(path) == key
    assert zmq.auth.load_certificate(path) == (key.public_key, key.secret_key)
    assert key.secret_key.decode() not in repr(key)


def test_a_key_file_is_not_overwritten_unless_asked(tmp_path):
    path = tmp_path / "cluster.key"
    curve.write_key_file(path, KEY)

    with pytest.raises(FileExistsError):
        curve.write_key_file(path, OTHER)
    kept = curve.load_key_file(path)
    curve.write_key_file(path, OTHER, overwrite=True)

    assert kept == KEY
    assert curve.load_key_file(path) == OTHER
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.key"]


def write(path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "cannot be read"),
        (curve.key_file_text(KEY)[: curve.key_file_text(KEY).index("secret-key") + 20].encode(), "no secret-key line"),
        (curve.key_file_text(KEY).encode()[:-20] + b'"\n', "not 40 characters"),
        (os.urandom(200) + b"\xff", "not text"),
        (b"public-key = 1\nsecret-key = 2\n", "no public-key line"),
        (curve.key_file_text(KEY).replace(KEY.secret_key.decode(), OTHER.secret_key.decode()).encode(), "belong"),
    ],
    ids=["missing", "truncated", "cut-key", "garbage", "not-a-key-file", "mismatched"],
)
def test_a_bad_key_file_is_a_clear_error_naming_the_file(tmp_path, content, reason):
    path = tmp_path / "cluster.key"
    if content is not None:
        write(path, content)

    with pytest.raises(CurveError) as error:
        curve.load_key_file(path)

    assert str(path) in str(error.value) and reason in str(error.value)


def test_a_context_with_a_curve_server_still_terminates():
    own = zmq.Context()
    bound(own, zmq.ROUTER, KEY)
    closing = threading.Thread(target=own.destroy, kwargs={"linger": 0})

    closing.start()
    closing.join(timeout=30)  # a hang guard: the ZAP handler must let destroy() finish

    assert not closing.is_alive() and own.closed
