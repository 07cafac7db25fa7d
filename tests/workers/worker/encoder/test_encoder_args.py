"""An encode worker's settings: role "encode" with its own settings, refused where they do not apply."""

import pytest

from workers.args import EngineArgs
from workers.worker.args import EMBEDDING_CACHE_BYTES, MAX_ENCODE_PATCHES, WorkerArgs

ENDPOINTS = {"request_endpoint": "ipc:///tmp/e.req", "heartbeat_endpoint": "ipc:///tmp/e.hb"}


def worker_args(**settings) -> WorkerArgs:
    engine = settings.pop("engine", EngineArgs(model="vlm"))
    return WorkerArgs(engine=engine, **ENDPOINTS, **settings)


def test_an_encode_worker_parses_and_writes_back_its_settings():
    argv = ["--model", "vlm", *("--request-endpoint", ENDPOINTS["request_endpoint"])]
    argv += ["--heartbeat-endpoint", ENDPOINTS["heartbeat_endpoint"], "--role", "encode"]
    argv += ["--embedding-cache-bytes", "4096", "--max-encode-patches", "1024"]

    parsed = WorkerArgs.from_argv(argv)

    assert (parsed.role, parsed.embedding_cache_bytes, parsed.max_encode_patches) == ("encode", 4096, 1024)
    assert WorkerArgs.from_argv(parsed.to_argv()) == parsed


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"role": "encode", "transfer_endpoint": "ipc:///tmp/e.kv"}, "only a decode worker has one"),
        ({"role": "encode", "swa_state_endpoint": "ipc:///tmp/e.swa"}, "no SWA state endpoint"),
        ({"role": "encode", "engine": EngineArgs(model="vlm", kv_store="/tmp/store")}, "no KV store"),
        ({"role": "encode", "embedding_cache_bytes": -1}, "embedding_cache_bytes must be >= 0"),
        ({"role": "encode", "max_encode_patches": 0}, "max_encode_patches must be positive"),
        ({"role": "prefill", "embedding_cache_bytes": 1}, "settings of encode workers only"),
        ({"role": "mixed", "max_encode_patches": 1}, "settings of encode workers only"),
    ],
)
def test_settings_that_do_not_fit_the_role_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        worker_args(**settings)


def test_the_defaults_fit_every_role():
    for role in ("mixed", "prefill", "encode"):
        args = worker_args(role=role)
        assert (args.embedding_cache_bytes, args.max_encode_patches) == (EMBEDDING_CACHE_BYTES, MAX_ENCODE_PATCHES)
