"""EP settings are checked where they are given: EngineArgs and their command-line flags, the worker's
config, and the model an EP engine is asked to serve (refused before any rank process starts)."""

import argparse

import pytest

from tests.workers.engine.expert_parallel.tiny_moe import QWEN3_MOE
from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.args import EngineArgs, add_engine_arguments
from workers.engine.factory import build_engine
from workers.engine.parallel.placement import PlacementError
from workers.worker.args import WorkerArgs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(ep_size=0), "ep_size must be at least 1"),
        (dict(ep_slots_per_rank=4), "needs ep_size > 1"),
        (dict(ep_size=2, ep_slots_per_rank=0), "ep_slots_per_rank must be >= 1"),
    ],
)
def test_bad_ep_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=QWEN3_MOE, **settings)


def test_ep_flags_parse_and_round_trip():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = EngineArgs.from_namespace(
        parser.parse_args(["--model", "m.json", "--ep-size", "4", "--ep-slots-per-rank", "3"])
    )
    assert (args.ep_size, args.ep_slots_per_rank) == (4, 3)
    assert EngineArgs.from_namespace(parser.parse_args(args.to_argv())) == args


def test_an_ep_worker_serves_whole_requests_only():
    with pytest.raises(ValueError, match="serves role mixed only"):
        WorkerArgs(
            engine=EngineArgs(model=QWEN3_MOE, ep_size=2),
            request_endpoint="ipc:///tmp/x.req",
            heartbeat_endpoint="ipc:///tmp/x.hb",
            role="prefill",
        )


@pytest.mark.parametrize(
    ("model", "settings", "error", "message"),
    [
        (TINY_CONFIGS["llama"], dict(ep_size=2), ValueError, "needs a mixture-of-experts model"),
        (QWEN3_MOE, dict(ep_size=2, ep_slots_per_rank=3), PlacementError, "cannot hold 8 experts"),
    ],
    ids=["dense-model", "too-few-slots"],
)
def test_an_ep_engine_refuses_what_it_cannot_serve_before_starting_ranks(model, settings, error, message):
    with pytest.raises(error, match=message):
        build_engine(EngineArgs(model=model, seed=0, kv_cache_bytes=1 << 20, **settings))
