"""Failover and migration of decode requests, on real worker processes (one prefill, two decode
workers sharing one KV store directory) driven through the EngineClient, in one run:

    python -m bench.failover [--quick] [--model smollm2-135m-instruct] [--output bench/results/failover_cpu.json]

For each prompt length (512 / 2,048 / 8,000 tokens; --quick: 128 / 512):
- failover: a greedy stream decodes `--tokens-before` tokens, then the decode worker holding it is
  SIGKILLed; recovery is the time from the kill to the stream's next token (the client notices the
  silence after its heartbeat timeout, then the other decode worker resumes the request from its
  checkpoint and the stored blocks), with the tokens that worker recomputed (its heartbeat counter);
- the peer: a rerun from the prompt, what a failover without persisted KV costs: the same request
  under a fresh cache namespace (nothing stored) timed from its start to the same next token, on
  the same workers;
- migration: a stream's decode worker is drained with no grace; the migration time is the longest
  gap between two of the stream's tokens around it (the KV moves over the transfer path).
Prints one JSON object and writes it to `--output`.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from workers.client.engine_client import EngineClient
from workers.engine import SamplingParams
from workers.protocol.messages import DrainRequest, GenerateRequest, ResumeRequest, WorkerHeartbeat

MODEL = "smollm2-135m-instruct"
HEARTBEAT_TIMEOUT_S = 1.0  # how soon the client gives up on a silent worker: part of every recovery
STARTUP_TIMEOUT_S = 300.0
ROOT = Path(__file__).resolve().parents[1]


class Cluster:
    """The worker processes, and a client connected to them."""

    def __init__(self, directory: Path, model: str, block_tokens: int) -> None:
        self.directory = directory
        self.model = model
        self.store = directory / "store"
        self.block_tokens = block_tokens
        self.processes: dict[str, subprocess.Popen] = {}
        self.client = EngineClient(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)

    def endpoints(self, name: str) -> tuple[str, str]:
        return f"ipc://{self.directory}/{name}.req", f"ipc://{self.directory}/{name}.hb"

    def start(self, name: str) -> None:
        role = "prefill" if name == "p" else "decode"
        request, heartbeat = self.endpoints(name)
        argv = [
            sys.executable, "-m", "workers.worker", "--model", self.model, "--role", role,
            "--worker-id", name, "--request-endpoint", request, "--heartbeat-endpoint", heartbeat,
            "--kv-store", str(self.store), "--kv-block-tokens", str(self.block_tokens),
            "--max-num-batched-tokens", "2048",
        ]  # fmt: skip
        if role == "decode":
            argv += ["--transfer-endpoint", f"ipc://{self.directory}/{name}.kv", "--kv-gc-interval", "0"]
        self.processes[name] = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.DEVNULL)

    async def connect(self) -> None:
        for name in ("p", "d0", "d1"):
            self.client.add_worker(*self.endpoints(name))
        await self.client.start()
        await self.wait(lambda beats: sum(b.state == "ready" for b in beats) == 3)

    async def wait(self, condition, timeout_s: float = STARTUP_TIMEOUT_S) -> list[WorkerHeartbeat]:
        deadline = time.monotonic() + timeout_s
        while not condition(beats := self.client.healthy_workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers never got there: {beats}")
            await asyncio.sleep(0.02)
        return beats

    def beat(self, name: str) -> WorkerHeartbeat | None:
        return next((b for b in self.client.healthy_workers() if b.worker_id == name), None)

    def kill(self, name: str) -> None:
        os.kill(self.processes[name].pid, signal.SIGKILL)
        self.processes[name].wait()

    def control(self, name: str, message: DrainRequest | ResumeRequest) -> None:
        with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.endpoints(name)[0])
            dealer.send(msgspec.msgpack.encode(message))
            if not dealer.poll(30_000):
                raise TimeoutError(f"{name} did not answer {type(message).__name__}")
            dealer.recv()

    async def close(self) -> None:
        await self.client.close()
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def request(name: str, prompt: list[int], max_tokens: int, namespace: str = "") -> GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(name, prompt, params, cache_namespace=namespace)


async def holder(cluster: Cluster) -> str:
    """The decode worker running the one stream in flight."""
    beats = await cluster.wait(lambda beats: any(b.role == "decode" and b.num_running for b in beats))
    return next(b.worker_id for b in beats if b.role == "decode" and b.num_running)


async def failover(cluster: Cluster, prompt: list[int], before: int, tag: str) -> dict:
    """Kill the stream's decode worker after `before` tokens; time to the next token, tokens recomputed."""
    arrivals: list[float] = []
    killed_at = 0.0
    victim = survivor = ""
    survivor_before: WorkerHeartbeat | None = None
    async for output in cluster.client.generate(request(f"failover-{tag}", prompt, before + 8)):
        arrivals.extend(time.perf_counter() for _ in output.token_ids)
        if len(arrivals) == before and not killed_at:
            victim = await holder(cluster)
            survivor = "d1" if victim == "d0" else "d0"
            survivor_before = cluster.beat(survivor)
            killed_at = time.perf_counter()
            cluster.kill(victim)
    after = await cluster.wait(
        lambda beats: any(b.worker_id == survivor and b.num_resumed > survivor_before.num_resumed for b in beats), 30
    )
    resumed = next(b for b in after if b.worker_id == survivor)
    recovery = next(t for t in arrivals[before:]) - killed_at
    cluster.start(victim)  # back for the next round
    await cluster.wait(lambda beats: cluster.beat(victim) is not None and cluster.beat(victim).state == "ready")
    return {
        "recovery_s": round(recovery, 4),
        "recomputed_tokens": resumed.num_recomputed_tokens - survivor_before.num_recomputed_tokens,
        "resumed": resumed.num_resumed - survivor_before.num_resumed,
    }


async def rerun(cluster: Cluster, prompt: list[int], before: int, tag: str) -> float:
    """Seconds from a fresh start (nothing stored for it) to the token after the first `before`."""
    started = time.perf_counter()
    count = 0
    async for output in cluster.client.generate(request(f"rerun-{tag}", prompt, before + 1, namespace=f"rerun-{tag}")):
        count += len(output.token_ids)
        if count > before:
            return time.perf_counter() - started
    return time.perf_counter() - started


async def migration(cluster: Cluster, prompt: list[int], before: int, tag: str) -> dict:
    """Drain the stream's decode worker with no grace after `before` tokens; the longest token gap."""
    arrivals: list[float] = []
    drained = ""
    async for output in cluster.client.generate(request(f"migrate-{tag}", prompt, before + 8)):
        arrivals.extend(time.perf_counter() for _ in output.token_ids)
        if len(arrivals) == before and not drained:
            drained = await holder(cluster)
            await asyncio.to_thread(cluster.control, drained, DrainRequest(f"drain-{tag}", grace_s=0.0))
    gaps = [later - earlier for earlier, later in zip(arrivals[before - 1 :], arrivals[before:])]
    steady = [later - earlier for earlier, later in zip(arrivals[1 : before - 1], arrivals[2:before])]
    await asyncio.to_thread(cluster.control, drained, ResumeRequest(f"resume-{tag}"))
    await cluster.wait(lambda beats: sum(b.state == "ready" for b in beats) == 3)
    return {
        "migration_gap_s": round(max(gaps), 4),
        "steady_token_gap_s": round(sorted(steady)[len(steady) // 2], 4) if steady else None,
    }


def token_range(model: str) -> range:
    """Token ids to draw prompts from: SmolLM2's ordinary ones, or a config file's whole vocabulary
    (a random-weight model built from a config, e.g. on a machine without the weights)."""
    if model.endswith(".json"):
        return range(json.loads(Path(model).read_text())["vocab_size"])
    return range(100, 40000)


async def measure(args) -> dict:
    rng = random.Random(0)
    ids = token_range(args.model)
    lengths = [128, 512] if args.quick else [512, 2048, 8000]
    results = []
    with tempfile.TemporaryDirectory(prefix="sluice-failover-") as directory:
        cluster = Cluster(Path(directory), args.model, args.block_tokens)
        for name in ("p", "d0", "d1"):
            cluster.start(name)
        try:
            await cluster.connect()
            for length in lengths:
                prompt = [rng.choice(ids) for _ in range(length)]
                row = {"prompt_tokens": length, "tokens_before": args.tokens_before}
                row |= await failover(cluster, prompt, args.tokens_before, str(length))
                row["rerun_s"] = round(await rerun(cluster, prompt, args.tokens_before, str(length)), 4)
                row["recovery_over_rerun"] = round(row["recovery_s"] / row["rerun_s"], 3)
                other = [rng.choice(ids) for _ in range(length)]
                row |= await migration(cluster, other, args.tokens_before, str(length))
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            await cluster.close()
    return {
        "benchmark": "failover",
        "model": args.model,
        "device": "cpu",
        "kv_block_tokens": args.block_tokens,
        "client_heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "quick": args.quick,
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prompts of 128 and 512 tokens")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--tokens-before", type=int, default=40, help="tokens streamed before the fault")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "failover_cpu.json"))
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
