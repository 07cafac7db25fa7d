"""The whole stack on a GPU, as a user runs it, against the offline engine on the same requests, in one run
(bench/gpu_stack.sh runs it on the accelerator machine):

    python3 -m bench.gpu_stack --model-dir DIR --out DIR [--steps serving,offline,acceptance,cached,equal]

`DIR` is a model directory (config.json and a tokenizer; no weights: random bf16 from the seed, the
same in every process). Each set-up starts `manage.py serve --device cuda --model DIR` on a fresh
SQLite database, drives it with `python -m bench.serve` over HTTP (completions, token-id prompts,
greedy, ignore_eos), and stops it. Steps:
- serving: 1 prefill + 1 decode worker (`split`), one mixed worker (`mixed`) and the offline engine
  (`offline`, this process; also a step of its own) at each --concurrency, --input-len-token prompts,
  --output-len tokens; the offline engine runs each concurrency's requests as one batch, and reports
  its decode alone too (from every request's first token to the last: the step time of that batch).
- acceptance: DeepSeek's acceptance mix scaled to one GPU, multi-turn sessions whose prompts reach
  ~16k tokens with ~90% from earlier turns, through the split stack with the KV store on and off (the
  engines' own prefix caches off, so that hits are the store's).
- cached: an 8,421-token prompt, then one sharing its first 8,400 tokens: the second's TTFT through
  the split stack (store off).
- equal: a streamed completion through the split stack equals the offline engine's greedy text.
Writes each run's bench.serve report and one summary JSON (`serving_gpu_<device>.json`) to --out,
and prints the summary.
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from workers.protocol.engine_request import EngineRequest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Stack:
    """`manage.py serve` on a throw-away SQLite database and var directory."""

    def __init__(self, model_dir: Path, scratch: Path, device: str, *options: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        database = f"sqlite:///{scratch}/db.sqlite3"
        # One client is the whole load here: the fair-admission cap on a tenant's prompt tokens waiting
        # for a first output (65,536 by default) refused half the acceptance mix's 8 concurrent
        # 14,400-token first turns with 429s.
        self.env = dict(
            os.environ,
            DATABASE_URL=database,
            SLUICE_VAR_DIR=str(scratch),
            PYTHONUNBUFFERED="1",
            SLUICE_TENANT_MAX_QUEUED_PROMPT_TOKENS=str(1 << 24),
        )
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run([*manage, "migrate", "--no-input"], env=self.env, check=True, capture_output=True)
        created = subprocess.run(
            [*manage, "create_api_key", "--tenant", "bench"], env=self.env, check=True, capture_output=True, text=True
        )
        self.api_key = created.stdout.strip().splitlines()[-1]
        self.log = scratch / "serve.log"
        started = time.monotonic()
        self.process = subprocess.Popen(
            [*manage, "serve", f"--port={self.port}", f"--device={device}", f"--model={model_dir}", *options],
            env=self.env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # serve stops (its workers with it) when this process dies, killed at a time limit too.
            preexec_fn=_die_with_parent,
        )
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT_S:
                self.stop()
                raise RuntimeError(f"serve {' '.join(options)} did not come up:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - started

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def bench_serve(stack: Stack, model_dir: Path, out: Path, name: str, *options: str) -> dict:
    report = out / f"{name}.json"
    subprocess.run(
        [sys.executable, "-m", "bench.serve", f"--base-url={stack.url}", f"--api-key={stack.api_key}",
         f"--model={model_dir.name}", f"--tokenizer={model_dir}", "--api=completions", "--ignore-eos", "--no-progress",
         f"--output={report}", *options],
        check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    full = json.loads(report.read_text())
    return {key: value for key, value in full.items() if key != "requests"}


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summary(report: dict) -> dict:
    return {
        "completed": report["completed"],
        "failed": report["failed"],
        "output_tok_s": report["output_token_throughput"],
        "ttft_median_ms": report["ttft_ms"]["median"],
        "ttft_p99_ms": report["ttft_ms"]["p99"],
        "tpot_median_ms": report["tpot_ms"]["median"],
        "itl_median_ms": report["itl_ms"]["median"],
        "server_hit_rate": report["prefix_cache"]["server_hit_rate"],
        "ideal_hit_rate": report["prefix_cache"]["ideal_hit_rate"],
    }


def serving(args, model_dir: Path, out: Path, results: dict) -> None:
    for setup, options in (("split", ["--prefill=1", "--decode=1"]), ("mixed", ["--workers=1"])):
        with tempfile.TemporaryDirectory(prefix="sluice-stack-") as scratch:
            limits = ["--no-kv-store", f"--max-model-len={args.max_model_len}"]
            stack = Stack(model_dir, Path(scratch), args.device, *options, *limits)
            try:
                rows = {"startup_s": round(stack.startup_s, 1)}
                for concurrency in args.concurrency:
                    report = bench_serve(
                        stack, model_dir, out, f"{setup}_c{concurrency}",
                        "--dataset=random", f"--random-input-len={args.input_len}", "--random-range-ratio=0",
                        f"--random-output-len={args.output_len}", f"--num-prompts={_prompts_for(concurrency)}",
                        f"--max-concurrency={concurrency}", f"--seed={concurrency}",
                    )  # fmt: skip
                    rows[f"c{concurrency}"] = summary(report)
                    print(setup, concurrency, json.dumps(rows[f"c{concurrency}"]), flush=True)
            finally:
                stack.stop()
            results["serving"][setup] = rows


def _prompts_for(concurrency: int) -> int:
    return max(8, 2 * concurrency)


def offline_engine(args, model_dir: Path):
    from workers.engine import LLM

    return LLM(model_dir, device=args.device, max_model_len=args.max_model_len)


def offline(args, llm) -> dict:
    """The offline engine on each concurrency's requests, all at once: output tokens per second over the
    whole run, like the served runs; and decode alone: the tokens and time from the moment every request
    has its first token (the prefills done) to the last, so the step time (TPOT) of a batch of that size."""
    from workers.engine import SamplingParams

    engine = llm.engine
    synchronize = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = {}
    for concurrency in [*args.concurrency[:1], *args.concurrency]:  # the first again: a warm-up
        prompts = [torch.randint(vocab, (args.input_len,), generator=generator).tolist() for _ in range(concurrency)]
        synchronize()
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            engine.add_request(
                EngineRequest(request_id=f"o{concurrency}-{index}-{started}", prompt_token_ids=prompt, params=params)
            )
        counts: dict[str, int] = {}
        prefilled_at, decoded, fewest = None, 0, 0
        while engine.has_unfinished():
            for delta in engine.step():
                counts[delta.request_id] = counts.get(delta.request_id, 0) + len(delta.token_ids)
                decoded += len(delta.token_ids) if prefilled_at is not None else 0
            if prefilled_at is None and len(counts) == concurrency:
                synchronize()
                prefilled_at, fewest = time.perf_counter(), min(counts.values())
        synchronize()
        ended = time.perf_counter()
        steps = max(args.output_len - fewest, 1)  # decode steps after the last first token
        rows[f"c{concurrency}"] = {
            "output_tok_s": round(sum(counts.values()) / (ended - started), 1),
            "decode_tok_s": round(decoded / (ended - prefilled_at), 1),
            "decode_step_ms": round((ended - prefilled_at) / steps * 1000, 3),
            "prefill_all_ms": round((prefilled_at - started) * 1000, 1),
        }
    return rows


def acceptance(args, model_dir: Path, out: Path, results: dict) -> None:
    mix = [
        "--dataset=multiturn", f"--sessions={args.sessions}", f"--turns={args.turns}",
        f"--first-turn-len={args.first_turn_len}", f"--turn-len={args.turn_len}", f"--output-len={args.turn_output}",
        f"--max-concurrency={args.sessions}",
    ]  # fmt: skip
    rows = {}
    # The engines' own prefix caches off in both runs: on one prefill worker they would hit every earlier
    # turn themselves, so the runs compare the global store's hits with recomputing them.
    for store in ("on", "off"):
        with tempfile.TemporaryDirectory(prefix="sluice-stack-") as scratch:
            store_options = ["--no-prefix-caching", *([] if store == "on" else ["--no-kv-store"])]
            stack = Stack(
                model_dir, Path(scratch), args.device, "--prefill=1", "--decode=1",
                f"--max-model-len={args.max_model_len}", *store_options,
            )  # fmt: skip
            try:
                report = bench_serve(stack, model_dir, out, f"acceptance_store_{store}", *mix)
            finally:
                stack.stop()
        rows[f"store_{store}"] = summary(report)
        print("acceptance", store, json.dumps(rows[f"store_{store}"]), flush=True)
    rows["ttft_store_on_over_off"] = round(rows["store_on"]["ttft_median_ms"] / rows["store_off"]["ttft_median_ms"], 3)
    hit, ideal = rows["store_on"]["server_hit_rate"], rows["store_on"]["ideal_hit_rate"]
    rows["hit_rate_over_ideal"] = round(hit / ideal, 3) if hit is not None and ideal else None
    results["acceptance"] = rows


def cached_and_equal(args, model_dir: Path, results: dict, steps: list[str]) -> str | None:
    """The cached step's results into `results`; the served text of the equality check, if asked."""
    served = None
    with tempfile.TemporaryDirectory(prefix="sluice-stack-") as scratch:
        stack = Stack(
            model_dir, Path(scratch), args.device, "--prefill=1", "--decode=1", "--no-kv-store",
            f"--max-model-len={args.max_model_len}",
        )  # fmt: skip
        try:
            if "cached" in steps:
                results["cached"] = cached_ttft(stack, model_dir)
                print("cached", json.dumps(results["cached"]), flush=True)
            if "equal" in steps:
                served = stream_completion(stack, model_dir, equal_prompt(model_dir), EQUAL_TOKENS)[1]
        finally:
            stack.stop()
    return served


def stream_completion(stack: Stack, model_dir: Path, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first text, the whole text) of one streamed greedy completion."""
    body = {
        "model": model_dir.name,
        "prompt": [prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started, first, text = time.perf_counter(), None, []
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter() - started
            text.append(piece)
    return first, "".join(text)


def cached_ttft(stack: Stack, model_dir: Path) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(7)
    base = torch.randint(1000, vocab, (8421,), generator=generator).tolist()
    stream_completion(stack, model_dir, base, 4)
    seconds = []
    for run in range(5):
        prompt = base[:8400] + torch.randint(1000, vocab, (21,), generator=generator).tolist()
        seconds.append(stream_completion(stack, model_dir, prompt, 4)[0])
    fresh = [torch.randint(1000, vocab, (1024,), generator=generator).tolist() for _ in range(3)]
    uncached = [stream_completion(stack, model_dir, prompt, 4)[0] for prompt in fresh]
    return {
        "handoffs_received": handoff_totals(stack),
        "prompt_tokens": 8421,
        "cached_tokens": 8400,
        "ttft_ms": [round(s * 1000, 1) for s in seconds],
        "ttft_median_ms": round(statistics.median(seconds) * 1000, 1),
        "uncached_1024_ttft_median_ms": round(statistics.median(uncached) * 1000, 1),
    }


EQUAL_TOKENS = 64


def handoff_totals(stack: Stack) -> dict:
    """The decode workers' KV handoffs received so far, by backend, from the gateway's /metrics: how many,
    their mean bytes and their mean seconds (from the first message's arrival to the KV usable)."""
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    totals: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for name in ("transfers", "bytes", "seconds"):
            prefix = f"sluice:kv_handoff_{name}_total{{"
            if line.startswith(prefix) and 'direction="received"' in line:
                backend = line.split('backend="', 1)[1].split('"', 1)[0]
                totals.setdefault(backend, {})[name] = totals.get(backend, {}).get(name, 0.0) + float(line.split()[-1])
    return {
        backend: {
            "transfers": int(row.get("transfers", 0)),
            "mean_mb": round(row.get("bytes", 0.0) / max(row.get("transfers", 1.0), 1.0) / 1e6, 1),
            "mean_ms": round(row.get("seconds", 0.0) / max(row.get("transfers", 1.0), 1.0) * 1000, 3),
        }
        for backend, row in totals.items()
    }


def equal_prompt(model_dir: Path) -> list[int]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return torch.randint(1000, vocab, (700,), generator=torch.Generator().manual_seed(11)).tolist()


def equal_to_offline(served: str, llm, args) -> dict:
    from workers.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=EQUAL_TOKENS, ignore_eos=True)
    offline_ids = llm.generate([equal_prompt(args.model_dir)], params)[0].token_ids
    offline_text = llm.engine.tokenizer.decode(offline_ids)
    return {"served_text_equals_offline": served == offline_text, "tokens": EQUAL_TOKENS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", default="serving,acceptance,cached,equal")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself, on a tiny model")
    parser.add_argument("--concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=700)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=20000)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-turn-len", type=int, default=14400)
    parser.add_argument("--turn-len", type=int, default=540)
    parser.add_argument("--turn-output", type=int, default=64)
    args = parser.parse_args()
    steps = args.steps.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict = {"benchmark": "serving_gpu", "device": device, "model": str(args.model_dir), "serving": {}}
    results["settings"] = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    # Every stack first, the offline engine last: the served workers take the whole device between
    # them, and an engine in this process keeps its share until the process ends.
    served = None
    if "serving" in steps:
        serving(args, args.model_dir, args.out, results)
    if "acceptance" in steps:
        acceptance(args, args.model_dir, args.out, results)
    if "cached" in steps or "equal" in steps:
        served = cached_and_equal(args, args.model_dir, results, steps)
    if "serving" in steps or "offline" in steps or served is not None:
        llm = offline_engine(args, args.model_dir)
        if "serving" in steps or "offline" in steps:
            results["serving"]["offline"] = offline(args, llm)
        if served is not None:
            results["equal"] = equal_to_offline(served, llm, args)
    name = device.lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"serving_gpu_{name}_{'_'.join(steps)}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
