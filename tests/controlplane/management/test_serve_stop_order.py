"""serve's stop order, with real processes of a KV store: an engine worker (a tiny random-weight model)
stopped in the middle of a stream that writes a block every 16 tokens, and the store's GC process
serving the index the worker writes through. The worker stops in an earlier stage than the index, so
once it has exited, every block it wrote, its last ones on the way out included, is in the index."""

import random
import shutil
import sys
import tempfile
from pathlib import Path

import zmq

from controlplane.management.commands.serve import STOP_SERVICES, STOP_WORKERS
from controlplane.supervisor import Child, StopStep, Supervisor, child_env
from tests.workers.worker_process import CONFIG, Dealer, endpoints, wait_for_worker_heartbeat, worker_command
from workers.engine import SamplingParams
from workers.kvstore.block_files import BlockFiles
from workers.kvstore.remote_index import RemoteIndex
from workers.protocol.messages import GenerateOutput, GenerateRequest

BLOCK_TOKENS = 16
PROMPT = [random.Random(2).randrange(CONFIG["vocab_size"]) for _ in range(100)]
GENERATED_BEFORE_STOP = 3 * BLOCK_TOKENS


def indexed_keys(endpoint: str) -> set[bytes]:
    context = zmq.Context()
    try:
        return {entry.key for entry in RemoteIndex(endpoint, context=context).entries()}
    finally:
        context.destroy(linger=0)


def test_the_store_index_outlives_the_workers_so_their_last_writes_are_indexed(tmp_path):
    # given serve's children of a store: a worker writing through the index the GC process serves
    runtime = Path(tempfile.mkdtemp(prefix="stop-order-"))  # ipc paths must be short
    store = tmp_path / "kvstore"
    index_endpoint = f"ipc://{runtime}/kv-index"
    store_gc = Child(
        name="kv-gc",
        argv=[
            sys.executable,
            "-m",
            "workers.kvstore.gc_process",
            f"--kv-store={store}",
            "--kv-store-index=memory",
            f"--serve-index={index_endpoint}",
            "--kv-gc-interval=3600",
        ],
        env=child_env(),
        stop_stage=STOP_SERVICES,
    )
    worker_options = [f"--kv-store={store}", f"--kv-store-index={index_endpoint}", f"--kv-block-tokens={BLOCK_TOKENS}"]
    worker = Child(
        name="worker-0",
        argv=worker_command(runtime, "worker-0", "--role=mixed", *worker_options, "--kv-gc-interval=0"),
        env=child_env(),
        stop_stage=STOP_WORKERS,
    )
    # What the index holds once the workers' stage is done (a step of that stage runs after its children exited).
    indexed_after_workers = []
    look = StopStep(STOP_WORKERS, lambda: indexed_after_workers.append(indexed_keys(index_endpoint)))
    supervisor = Supervisor([store_gc, worker], stop_steps=[look])
    request_endpoint, heartbeat_endpoint = endpoints(runtime, "worker-0")
    try:
        for child in supervisor.children:
            child.start()
        wait_for_worker_heartbeat(heartbeat_endpoint)
        with Dealer(request_endpoint) as dealer:
            greedy = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
            dealer.send(GenerateRequest("long", PROMPT, greedy, traffic_class="agent"))
            generated = 0
            while generated < GENERATED_BEFORE_STOP:
                output = dealer.receive()
                assert isinstance(output, GenerateOutput) and output.finish_reason is None, output
                generated += len(output.token_ids)

            # when serve's order stops them, the worker mid-stream
            supervisor._stop_all()
    finally:
        for child in supervisor.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        shutil.rmtree(runtime)

    # then the worker stopped cleanly, and every block file it wrote was in the index after it exited
    assert worker.process.returncode == 0 and store_gc.process.returncode == 0
    on_disk = {key for key, _, _ in BlockFiles(store).listing()}
    assert len(on_disk) >= (len(PROMPT) + GENERATED_BEFORE_STOP) // BLOCK_TOKENS
    assert indexed_after_workers == [on_disk]
