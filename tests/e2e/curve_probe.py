"""An outsider's attempts on a cluster's data plane, run on a host without the cluster's key
(tests/e2e/test_multihost.py starts it in a namespace of its own). It tries, in each of three ways at
once, to submit a request to a worker's ROUTER, to push a KV transfer message to its PULL and to
register a worker with the registry, listens for `--seconds`, and prints one JSON line: per way, the
answers its request and registration got.

Ways: "plain" (no CURVE at all), "own-keypair" (CURVE with a keypair of its own, knowing the cluster's
public key: the handshake completes and the worker's ZAP handler must refuse it), "wrong-key" (another
cluster's keypair, used as the cluster's own: the handshake itself fails). Raw sockets on purpose: an
outsider does not use workers.curve, which would refuse to connect without a key.
"""

import argparse
import json
import time

import msgspec
import zmq

from workers.protocol.messages import GenerateRequest, WorkerRegistration
from workers.protocol.sampling_params import SamplingParams

WAYS = ("plain", "own-keypair", "wrong-key")


def secure(socket: zmq.Socket, way: str, cluster_public_key: bytes) -> None:
    if way == "plain":
        return
    public_key, secret_key = zmq.curve_keypair()
    socket.curve_publickey, socket.curve_secretkey = public_key, secret_key
    socket.curve_serverkey = cluster_public_key if way == "own-keypair" else public_key


def send_attempts(way: str, args: argparse.Namespace, context: zmq.Context) -> dict[str, zmq.Socket]:
    """One way's request, KV transfer message and registration, sent; its sockets (kept open: closing
    one drops what it has not delivered yet)."""
    sockets = {"request": context.socket(zmq.DEALER), "transfer": context.socket(zmq.DEALER)}
    sockets["register"] = context.socket(zmq.DEALER)
    for name, socket in sockets.items():
        socket.linger = 0
        secure(socket, way, args.cluster_public_key.encode())
        socket.connect(getattr(args, f"{name}_endpoint"))
    request = GenerateRequest(f"outsider-{way}", list(range(1, 30)), SamplingParams(max_tokens=4))
    registration = WorkerRegistration(
        worker_id=f"outsider-{way}",
        pool="decode",
        role="decode",
        model="any",
        hostname="outsider",
        request_endpoint="tcp://outsider:7100",
        heartbeat_endpoint="tcp://outsider:7101",
        started_at=time.time(),
    )
    # Whole but for its dtype: a worker that read it would fail the request it names at once.
    transfer_header = msgspec.msgpack.encode(
        {"type": "kv_header", "request_id": f"{args.transfer_request_id}-{way}", "prompt_token_ids": [1]}
        | {"output_token_ids": [2], "params": {}, "num_computed_tokens": 1, "num_cached_tokens": 0}
        | {"traffic_class": "chat", "cache_namespace": "", "kv_model_id": "x", "dtype": "int8"}
        | {"kv_layout": "x", "layer_shape": [2, 1, 1, 1], "num_layers": 1, "chunk_layers": 1}
    )
    sockets["request"].send(msgspec.msgpack.encode(request))
    sockets["register"].send(msgspec.msgpack.encode(registration))
    sockets["transfer"].send_multipart([transfer_header, b"\x00" * 4])
    return sockets


def answers(listening: dict[str, dict[str, zmq.Socket]], seconds: float) -> dict[str, dict[str, int]]:
    """How many answers each way's request and registration got within `seconds`."""
    counts = {way: {"request": 0, "register": 0} for way in listening}
    poller = zmq.Poller()
    owner = {}
    for way, sockets in listening.items():
        for name in counts[way]:
            poller.register(sockets[name], zmq.POLLIN)
            owner[sockets[name]] = (way, name)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for socket, _ in poller.poll(left * 1000):
            socket.recv()
            way, name = owner[socket]
            counts[way][name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("request", "transfer", "register"):
        parser.add_argument(f"--{name}-endpoint", required=True)
    parser.add_argument("--cluster-public-key", required=True, help="Z85: public, as its name says")
    parser.add_argument("--transfer-request-id", required=True, help="the KV sent names <this>-<way>")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to listen for answers")
    args = parser.parse_args()
    with zmq.Context() as context:
        listening = {way: send_attempts(way, args, context) for way in WAYS}
        print(json.dumps(answers(listening, args.seconds)))


if __name__ == "__main__":
    main()
