"""EngineArgs: one definition of every engine setting, from which the command line, the offline LLM,
the worker's settings and the engine's config are all built; WorkerArgs, the worker's own, the same way."""

import argparse

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.args import EngineArgs, add_engine_arguments
from workers.cost_model import PrefillCostModel
from workers.engine import LLM
from workers.engine.builder import engine_config
from workers.engine.dtypes import dtype_name, torch_dtype
from workers.engine.factory import build_engine
from workers.worker.args import WorkerArgs, add_worker_arguments


def parse(argv: list[str], **defaults) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, defaults=defaults)
    return EngineArgs.from_namespace(parser.parse_args(argv))


def test_the_command_line_defaults_are_the_fields_defaults():
    assert parse(["--model", "m"]) == EngineArgs(model="m")


def test_every_setting_has_an_option_and_to_argv_gives_them_back():
    args = EngineArgs(
        model="m",
        tokenizer="t",
        device="cuda:1",
        dtype="bfloat16",
        seed=7,
        attention_backend="torch_sdpa",
        page_size=32,
        num_pages=100,
        kv_cache_bytes=1 << 20,
        gpu_memory_utilization=0.45,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        enable_prefix_caching=False,
        max_waiting=3,
        kv_store="/tmp/store",
        kv_store_index="redis://127.0.0.1:6379/0",
        kv_block_tokens=64,
        cost_model="/tmp/cost.json",
        step_budget_ms=25.5,
        enforce_eager=True,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )

    argv = args.to_argv()

    assert "--no-prefix-caching" in argv and "--enforce-eager" in argv
    assert "--gpu-memory-utilization=0.45" in argv
    assert "--quantization=fp8" in argv and "--kv-cache-dtype=fp8" in argv
    assert parse(argv) == args


def test_to_argv_leaves_defaults_out():
    assert EngineArgs(model="m").to_argv() == ["--model=m"]


def test_model_is_required_unless_given_a_default():
    with pytest.raises(SystemExit):
        parse([])
    assert parse([], model="smollm2-135m-instruct", kv_store="/var/kv").kv_store == "/var/kv"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"page_size": 24}, "page_size"),
        ({"num_pages": 1}, "num_pages"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.01}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": -0.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"kv_block_tokens": 40}, "kv_block_tokens"),
        ({"max_waiting": 0}, "max_waiting"),
        ({"step_budget_ms": 50}, "step_budget_ms"),
        ({"step_budget_ms": 0, "cost_model": "c.json"}, "step_budget_ms"),
    ],
)
def test_a_bad_setting_is_a_value_error_naming_it(settings, named):
    with pytest.raises(ValueError, match=named):
        EngineArgs(model="m", **settings)


def test_a_bad_setting_on_the_command_line_is_refused_when_parsed():
    with pytest.raises(ValueError, match="page_size"):
        parse(["--model", "m", "--page-size", "12"])


def test_gpu_memory_utilization_from_the_command_line():
    assert parse(["--model", "m", "--gpu-memory-utilization", "0.3"]).gpu_memory_utilization == 0.3
    assert parse(["--model", "m"]).gpu_memory_utilization == 0.9
    assert EngineArgs(model="m", gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        parse(["--model", "m", "--gpu-memory-utilization", "1.5"])


def test_kv_cache_bytes_is_left_to_the_device_unless_given():
    assert parse(["--model", "m"]).kv_cache_bytes is None
    assert parse(["--model", "m", "--kv-cache-bytes", "4096"]).kv_cache_bytes == 4096


def test_dtypes_by_name_and_by_torch_dtype():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="dtype"):
        dtype_name(torch.int8)


def test_the_worker_config_holds_the_engine_args():
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    argv = ["--model=m", "--request-endpoint=ipc:///a", "--heartbeat-endpoint=ipc:///b", "--enforce-eager"]

    config = WorkerArgs.from_namespace(parser.parse_args([*argv, "--role=prefill", "--max-num-seqs=4"]))

    assert config.role == "prefill"
    assert config.engine == EngineArgs(model="m", max_num_seqs=4, enforce_eager=True)


def test_worker_args_round_trip_through_their_command_line():
    # given a worker with every one of its own settings away from its default
    args = WorkerArgs(
        engine=EngineArgs(model="m", max_num_seqs=4, enforce_eager=True),
        request_endpoint="tcp://*:7100",
        heartbeat_endpoint="tcp://*:7101",
        worker_id="decode-3",
        role="decode",
        heartbeat_interval_s=0.25,
        kv_gc_interval_s=0,
        kv_store_capacity_bytes=1 << 20,
        kv_eviction_policy="lru",
        pool="decode",
        registry_endpoint="tcp://registry:7000",
        transfer_endpoint="tcp://*:7102",
        transfer_timeout_s=30.0,
        advertise_host="decode-host",
        curve_key_file="/keys/cluster.key",
    )
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)

    # when the worker's parser reads the command line they give, and when from_argv does
    parsed = WorkerArgs.from_namespace(parser.parse_args(args.to_argv()))

    # then both give the same settings back
    assert parsed == args
    assert WorkerArgs.from_argv(args.to_argv()) == args


def test_a_worker_left_at_its_defaults_gives_only_what_it_needs():
    args = WorkerArgs(engine=EngineArgs(model="m"), request_endpoint="ipc:///r", heartbeat_endpoint="ipc:///h")

    assert args.to_argv() == ["--model=m", "--request-endpoint=ipc:///r", "--heartbeat-endpoint=ipc:///h"]


def test_from_argv_lets_the_given_settings_win_and_refuses_bad_options():
    host_options = ["--kv-cache-bytes=4096", "--model=other", "--role=prefill"]

    args = WorkerArgs.from_argv(host_options, model="m", role="mixed", request_endpoint="r", heartbeat_endpoint="h")

    assert args == WorkerArgs(
        engine=EngineArgs(model="m", kv_cache_bytes=4096), request_endpoint="r", heartbeat_endpoint="h"
    )
    with pytest.raises(ValueError, match="--no-such-option"):
        WorkerArgs.from_argv(["--no-such-option"], model="m", request_endpoint="r", heartbeat_endpoint="h")


def test_engine_config_resolves_the_settings():
    cost_model = PrefillCostModel(a=0.0, b=0.001, d=0.0, e=0.0)
    args = EngineArgs(model="m", dtype="float16", cost_model=cost_model, step_budget_ms=20, enforce_eager=True)

    config = engine_config(args)

    assert (config.args, config.dtype, config.cost_model, config.step_budget_s) == (
        args,
        torch.float16,
        cost_model,
        0.02,
    )
    unset = engine_config(EngineArgs(model="m"))
    assert (unset.dtype, unset.cost_model, unset.step_budget_s) == (None, None, None)


def test_llm_keywords_go_through_engine_args(tmp_path):
    llm = LLM(
        TINY_CONFIGS["llama"],
        seed=0,
        dtype=torch.float32,
        num_pages=8,
        max_waiting=2,
        enforce_eager=True,
        kv_store=tmp_path / "store",
    )

    config = llm.engine.config
    assert config.dtype == torch.float32
    assert (config.args.num_pages, config.args.max_waiting, config.args.enforce_eager) == (8, 2, True)
    assert llm.engine.store is not None
    llm.close()


def test_llm_refuses_an_unknown_setting():
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(TINY_CONFIGS["llama"], no_such_setting=1)


def test_build_engine_loads_a_model_from_a_config():
    engine = build_engine(EngineArgs(model=TINY_CONFIGS["llama"], num_pages=8, max_num_seqs=2))

    assert engine.stats().num_pages == 7  # one page is reserved
    assert engine.config.args.max_num_seqs == 2
