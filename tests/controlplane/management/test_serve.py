"""What `serve` works out for its workers before and after they start: their command line (the node
agent's too), each worker's share of a CUDA device they share, and the line that reports their KV
caches once they are up."""

import io

import pytest
from django.core.management.base import OutputWrapper

from controlplane.management.commands import serve
from controlplane.management.commands.serve import KVCacheReport, engines_by_role, with_device_share
from workers.args import EngineArgs
from workers.worker import node_agent
from workers.worker.args import WorkerArgs
from workers.worker.node_agent import NodeAgent, WorkerLaunch


@pytest.mark.parametrize(
    ("device", "num_workers", "expected"),
    [
        ("cuda", 2, 0.45),
        ("cuda:1", 3, 0.3),
        ("cuda", 1, 0.9),
        ("cpu", 2, 0.9),  # the CPU sizes its cache in bytes: nothing to share
    ],
)
def test_workers_on_one_cuda_device_split_its_memory(device, num_workers, expected):
    engine = EngineArgs(model="m", device=device)

    shared = with_device_share(engine, num_workers)

    assert shared.gpu_memory_utilization == pytest.approx(expected)
    assert shared == EngineArgs(model="m", device=device, gpu_memory_utilization=shared.gpu_memory_utilization)


@pytest.mark.parametrize("budget", ["fixed", "dspark"])
def test_decode_workers_run_unbudgeted_and_keep_the_cost_model_only_for_dspark(budget):
    engine = EngineArgs(model="m", cost_model="/fit.json", step_budget_ms=50.0, spec_method="ngram", spec_budget=budget)

    engines = engines_by_role(engine)

    assert engines["prefill"] == engines["mixed"] == engine
    decode = engines["decode"]
    assert decode.step_budget_ms is None and decode.spec_budget == budget
    assert decode.cost_model == ("/fit.json" if budget == "dspark" else None)
    assert engines["encode"].kv_store is None


def test_each_workers_share_reaches_its_command_line():
    engine = EngineArgs(model="m", device="cuda", gpu_memory_utilization=0.8)

    argv = with_device_share(engine, 4).to_argv()

    assert "--gpu-memory-utilization=0.2" in argv


def test_serve_and_the_node_agent_start_a_worker_with_the_command_line_of_one_worker_args(tmp_path, monkeypatch):
    # given a node agent with the options serve gives the workers it adds, its worker processes caught
    engine = EngineArgs(model="m", max_num_seqs=4, kv_store="/kv")
    started = []
    monkeypatch.setattr(node_agent.subprocess, "Popen", lambda argv, **_: started.append(argv) or FakeProcess())
    agent = NodeAgent(
        runtime_dir=tmp_path,
        registry_endpoint="ipc:///registry",
        worker_options=lambda role: [*engine.to_argv(), "--kv-gc-interval=0"],
        on_exit=lambda *exit: None,
    )

    # when it starts a decode worker
    agent.start(WorkerLaunch(1, "decode-1", "decode", "decode", "m"))

    # then its command line is that of the worker's WorkerArgs, and serve's for the same worker differs
    # only in how the worker is run
    args = WorkerArgs(
        engine=engine,
        role="decode",
        pool="decode",
        worker_id="decode-1",
        request_endpoint=f"ipc://{tmp_path}/decode-1.req",
        heartbeat_endpoint=f"ipc://{tmp_path}/decode-1.hb",
        transfer_endpoint=f"ipc://{tmp_path}/decode-1.kv",
        registry_endpoint="ipc:///registry",
        kv_gc_interval_s=0.0,
    )
    assert started == [node_agent.worker_command(args)]
    assert started[0][1:3] == ["-m", "workers.worker"]
    assert serve.worker_command(args)[1:] == ["-m", "controlplane.manage", "run_worker", *started[0][3:]]


def test_the_node_agent_starts_a_worker_in_its_pool_s_precision_whatever_the_host_options_say(tmp_path, monkeypatch):
    # given a host whose options quantize, and a pool that asks for unquantized weights and an FP8 KV cache
    started = []
    monkeypatch.setattr(node_agent.subprocess, "Popen", lambda argv, **_: started.append(argv) or FakeProcess())
    agent = NodeAgent(
        runtime_dir=tmp_path,
        registry_endpoint="ipc:///registry",
        worker_options=lambda role: ["--quantization=fp8", "--max-num-seqs=4"],
        on_exit=lambda *exit: None,
    )

    # when it starts one of the pool's workers
    agent.start(WorkerLaunch(1, "mixed-1", "mixed", "mixed", "m", quantization=None, kv_cache_dtype="fp8"))

    # then the worker runs as the pool says, with the host's other options
    engine = WorkerArgs.from_argv(started[0][3:]).engine
    assert (engine.quantization, engine.kv_cache_dtype, engine.max_num_seqs) == (None, "fp8", 4)


class FakeProcess:
    pid = 4242


def test_the_kv_cache_line_waits_for_every_worker_to_report_its_capacity(make_pool, make_instance):
    out = io.StringIO()
    report = KVCacheReport(["prefill-0", "decode-0"], OutputWrapper(out))
    prefill, decode = make_pool("prefill", kind="prefill"), make_pool("decode")
    make_instance(prefill, worker_id="prefill-0", kv_capacity_tokens=301_456)
    report()
    decode_0 = make_instance(decode, worker_id="decode-0")  # registered, no heartbeat yet
    report()
    assert out.getvalue() == ""

    decode_0.kv_capacity_tokens = 1_234
    decode_0.save(update_fields=["kv_capacity_tokens"])
    report()
    report()

    assert out.getvalue() == "sluice's workers are up. KV cache: prefill-0 301,456 tokens, decode-0 1,234 tokens\n"


def test_workers_registered_before_serve_started_are_not_reported(make_pool, make_instance):
    out = io.StringIO()
    make_instance(make_pool(), worker_id="decode-0", kv_capacity_tokens=8_192)
    report = KVCacheReport(["decode-0"], OutputWrapper(out))

    report()

    assert out.getvalue() == ""
