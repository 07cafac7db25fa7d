"""What a sliding-window model's worker tells the entrypoint (WorkerHeartbeat.swa_layers) and what a request
tells the worker (GenerateRequest.swa_holders): they round-trip, an older peer's messages without them
decode with their defaults, and bad or missing fields are refused naming the field."""

import msgspec
import pytest

from tests.workers.worker.test_heartbeat_compat import BASE
from workers.engine import SamplingParams
from workers.protocol.messages import (
    MAX_SWA_HOLDERS,
    GenerateRequest,
    SwaHolder,
    SwaLayers,
    WorkerHeartbeat,
    WorkerInbound,
)

LAYERS = SwaLayers(window=128, num_layers=20, replay="approximate", state_endpoint="tcp://host-a:7301")


def test_the_swa_layers_and_holders_round_trip():
    heartbeat = WorkerHeartbeat(**BASE, swa_layers=LAYERS)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(heartbeat), type=WorkerHeartbeat) == heartbeat
    request = GenerateRequest("r", [1, 2], SamplingParams(), swa_holders=(SwaHolder("a", "tcp://host-a:7301"),))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=WorkerInbound) == request


def test_messages_without_them_decode_as_a_model_without_sliding_windows():
    old_heartbeat = msgspec.msgpack.encode({"type": "heartbeat", **BASE})
    assert msgspec.msgpack.decode(old_heartbeat, type=WorkerHeartbeat).swa_layers is None
    old_request = msgspec.msgpack.encode(
        {
            "type": "generate",
            "request_id": "r",
            "prompt_token_ids": [1],
            "params": msgspec.to_builtins(SamplingParams()),
        }
    )
    assert msgspec.msgpack.decode(old_request, type=WorkerInbound).swa_holders == ()


@pytest.mark.parametrize(
    "layers, error",
    [
        ({"window": 0, "num_layers": 2, "replay": "approximate"}, "swa_layers.window"),
        ({"window": 8, "num_layers": 0, "replay": "approximate"}, "swa_layers.num_layers"),
        ({"window": 8, "num_layers": 2, "replay": "sometimes"}, "swa_layers.replay"),
        ({"window": 8, "num_layers": 2}, "missing required field `replay`"),
        ({"window": "8", "num_layers": 2, "replay": "exact"}, "swa_layers.window"),
    ],
)
def test_a_heartbeat_with_bad_swa_layers_is_refused_naming_the_field(layers, error):
    payload = msgspec.msgpack.encode({"type": "heartbeat", **BASE, "swa_layers": layers})
    with pytest.raises(msgspec.ValidationError, match=error.replace(".", r"\.").replace("`", ".")):
        msgspec.msgpack.decode(payload, type=WorkerHeartbeat)


@pytest.mark.parametrize(
    "holders, error",
    [
        ([{"worker_id": "", "endpoint": "ipc://a"}], r"swa_holders\[0\]\.worker_id"),
        ([{"worker_id": "a"}], "missing required field `endpoint`"),
        ([{"worker_id": "a", "endpoint": "ipc://a", "port": 1}], "unknown field `port`"),
        ([{"worker_id": f"w{i}", "endpoint": "ipc://a"} for i in range(MAX_SWA_HOLDERS + 1)], "swa_holders"),
    ],
)
def test_a_request_with_bad_swa_holders_is_refused_naming_the_field(holders, error):
    payload = msgspec.msgpack.encode(
        {
            "type": "generate",
            "request_id": "r",
            "prompt_token_ids": [1],
            "params": msgspec.to_builtins(SamplingParams()),
            "swa_holders": holders,
        }
    )
    with pytest.raises(msgspec.ValidationError, match=error):
        msgspec.msgpack.decode(payload, type=WorkerInbound)
