"""`python -m bench.serve`: flags, the checks argparse cannot make, the dataset, the run, the JSON out.

Every bad flag or unreadable input ends the command with argparse's one-line error, before any load."""

import argparse
import asyncio
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import bench.serve
from bench.serve.api_protocols import API_PROTOCOLS, GenerationSettings
from bench.serve.arrivals import send_offsets
from bench.serve.datasets.mooncake import mooncake_requests, read_trace
from bench.serve.datasets.multiturn import multiturn_requests
from bench.serve.datasets.random_prompts import random_requests
from bench.serve.datasets.request import BenchRequest, DatasetError
from bench.serve.datasets.sharegpt import sharegpt_requests
from bench.serve.metrics import SLO_METRICS
from bench.serve.prefix_reuse import ideal_hit_rate
from bench.serve.report import build_report
from bench.serve.run import run_benchmark
from bench.serve.tokenizer import BenchTokenizer, TokenizerNotFound

DEFAULT_NUM_PROMPTS = 1000
# The flags each dataset reads, reported in the settings beside the general ones.
DATASET_FLAGS = {
    "random": ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"),
    "sharegpt": (
        "dataset_path",
        "num_prompts",
        "sharegpt_output_len",
        "sharegpt_max_input_len",
        "sharegpt_max_total_len",
    ),
    "mooncake": ("dataset_path", "num_prompts", "block_size", "time_scale"),
    "multiturn": ("sessions", "turns", "first_turn_len", "turn_len", "output_len"),
}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        tokenizer = BenchTokenizer.load(args.tokenizer or args.model)
        requests = _requests(args, tokenizer)
    except (TokenizerNotFound, DatasetError) as error:
        parser.error(str(error))
    api = API_PROTOCOLS[args.api]
    if api.needs_text:
        requests = [replace(r, text=tokenizer.decode(r.prompt_ids)) if r.text is None else r for r in requests]
    ideal = ideal_hit_rate((request.prompt_ids for request in requests), args.cache_block_size)
    offsets = send_offsets(requests, request_rate=args.request_rate, time_scale=args.time_scale, seed=args.seed)
    outcome = asyncio.run(
        run_benchmark(
            requests,
            offsets,
            api=api,
            server_url=_server_root(args.base_url),
            api_key=args.api_key,
            generation=GenerationSettings(model=args.model, temperature=args.temperature, ignore_eos=args.ignore_eos),
            max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout,
            progress=not args.no_progress,
        )
    )
    report = build_report(
        settings=_settings(args, len(requests)),
        results=outcome.results,
        duration_s=outcome.duration_s,
        slo_ms=args.slo,
        server_prefix_cache=outcome.server_prefix_cache,
        ideal_hit_rate=ideal,
    )
    text = json.dumps(report)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        usage="%(prog)s --base-url URL --model NAME [options]",
        description=bench.serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", required=True, help="the server's root, e.g. http://127.0.0.1:8000 (a /v1 is dropped)"
    )
    server.add_argument("--api", choices=sorted(API_PROTOCOLS), default="completions")
    server.add_argument("--model", required=True, help="the model name sent with each request")
    server.add_argument("--api-key", default=os.environ.get("BENCH_API_KEY"), help="default: $BENCH_API_KEY")
    server.add_argument(
        "--tokenizer", help="a directory with tokenizer.json, the file, or a packaged model name (default: --model)"
    )
    server.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, help="requests/s, Poisson; inf (default) sends all at once")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    load.add_argument(
        "--num-prompts", type=int, help=f"requests (random, sharegpt: {DEFAULT_NUM_PROMPTS}; mooncake: all)"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    load.add_argument("--slo", type=_slo, default={}, help="objectives in ms for goodput, e.g. ttft=500,tpot=50")
    load.add_argument("--cache-block-size", type=int, default=16, help="the server's cache block, in tokens")
    load.add_argument("--output", help="also write the report to this file")
    load.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    data = parser.add_argument_group("datasets")
    data.add_argument("--dataset", choices=sorted(DATASET_FLAGS), default="random")
    data.add_argument("--dataset-path", help="the sharegpt JSON file or the mooncake JSONL trace")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--sharegpt-output-len", type=int, help="every request's output length (default: the answer's)")
    data.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    data.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    data.add_argument("--block-size", type=int, default=512, help="tokens per mooncake hash id")
    data.add_argument("--time-scale", type=float, default=1.0, help="multiplies a trace's timestamps")
    data.add_argument("--sessions", type=int, default=8)
    data.add_argument("--turns", type=int, default=4)
    data.add_argument("--first-turn-len", type=int, default=1024)
    data.add_argument("--turn-len", type=int, default=256)
    data.add_argument("--output-len", type=int, default=128, help="multiturn output tokens per turn")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if urlsplit(args.base_url).scheme not in ("http", "https"):
        parser.error(f"--base-url must be an http(s) URL, got {args.base_url!r}")
    if args.request_rate is not None and not args.request_rate > 0:
        parser.error("--request-rate must be > 0 (inf: all at once)")
    positive = {
        "--max-concurrency": args.max_concurrency,
        "--num-prompts": args.num_prompts,
        "--time-scale": args.time_scale,
        "--cache-block-size": args.cache_block_size,
        "--request-timeout": args.request_timeout,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    if not 0.0 <= args.temperature <= 2.0:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.dataset in ("sharegpt", "mooncake") and not args.dataset_path:
        parser.error(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "multiturn" and args.num_prompts is not None:
        parser.error("--dataset multiturn sends --sessions x --turns requests; drop --num-prompts")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        parser.error(f"--output {args.output}: its directory does not exist")


def _slo(text: str) -> dict[str, float]:
    objectives = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in SLO_METRICS:
            raise argparse.ArgumentTypeError(f"{item!r}: objectives are {', '.join(SLO_METRICS)} (e.g. ttft=500)")
        try:
            objectives[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the objective needs a number of ms") from None
    return objectives


def _requests(args: argparse.Namespace, tokenizer: BenchTokenizer) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(
            num_prompts=args.num_prompts or DEFAULT_NUM_PROMPTS,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            ordinary_ids=tokenizer.ordinary_ids,
            seed=args.seed,
        )
    if args.dataset == "sharegpt":
        return sharegpt_requests(
            Path(args.dataset_path),
            num_prompts=args.num_prompts or DEFAULT_NUM_PROMPTS,
            tokenizer=tokenizer,
            seed=args.seed,
            output_len=args.sharegpt_output_len,
            max_input_len=args.sharegpt_max_input_len,
            max_total_len=args.sharegpt_max_total_len,
        )
    if args.dataset == "mooncake":
        return mooncake_requests(
            read_trace(Path(args.dataset_path)),
            block_size=args.block_size,
            ordinary_ids=tokenizer.ordinary_ids,
            seed=args.seed,
            num_prompts=args.num_prompts,
        )
    return multiturn_requests(
        sessions=args.sessions,
        turns=args.turns,
        first_turn_len=args.first_turn_len,
        turn_len=args.turn_len,
        output_len=args.output_len,
        ordinary_ids=tokenizer.ordinary_ids,
        seed=args.seed,
    )


def _server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def _settings(args: argparse.Namespace, num_requests: int) -> dict:
    parts = urlsplit(_server_root(args.base_url))
    # Credentials in the URL stay out of the report, as the key does.
    base_url = urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
    if args.request_rate is not None:
        rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    else:
        rate = "trace timestamps" if args.dataset == "mooncake" else "inf"
    return {
        "base_url": base_url,
        "api": args.api,
        "model": args.model,
        "tokenizer": args.tokenizer or args.model,
        "dataset": args.dataset,
        "requests": num_requests,
        "request_rate": rate,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "cache_block_size": args.cache_block_size,
        **{flag: getattr(args, flag) for flag in DATASET_FLAGS[args.dataset]},
    }
