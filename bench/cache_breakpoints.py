"""What placing cache breakpoints adds to preparing a request (recipe.cache_breakpoints: one more
conversion and rendering of the marked body, and a walk over the prompt's tokens), against the same
request without them (the peer), in one run.

    python -m bench.cache_breakpoints [--turns 4 32 128] [--repeats 21]

An Anthropic Messages agent conversation with the real SmolLM2 tokenizer: a system prompt, three
tools, and `turns` rounds of a user question, a tool call and its result; with breakpoints on the
last tool and the system prompt (1h), the last tool result and the last user text (5m). Medians of
prepare_request in milliseconds; `overhead` is with over without. Prints one JSON object.
"""

import argparse
import json
import statistics
import time

import deepseek_recipe as dr

from recipe.api import ServedModel, prepare_request
from workers.engine.weights import resolve_model

MODEL = "smollm2-135m-instruct"
HOUR = {"type": "ephemeral", "ttl": "1h"}
FIVE_MINUTES = {"type": "ephemeral"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    files = resolve_model(MODEL, progress=False)
    model = ServedModel.from_model_files(files, max_model_len=1 << 20)
    models = {MODEL: model}
    rows = []
    for turns in args.turns:
        plain, hinted = conversation(turns, hints=False), conversation(turns, hints=True)
        prepared = prepare_request("messages", hinted, models)
        without_ms, with_ms = _medians_ms(
            [lambda: prepare_request("messages", plain, models), lambda: prepare_request("messages", hinted, models)],
            args.repeats,
        )
        rows.append(
            {
                "turns": turns,
                "prompt_tokens": len(prepared.prompt_token_ids),
                "hints": [hint.prefix_tokens for hint in prepared.cache_hints],
                "without_ms": without_ms,
                "with_ms": with_ms,
                "overhead": round(with_ms / without_ms, 3),
            }
        )
    print(json.dumps({"model": MODEL, "deepseek_recipe": dr.__version__, "rows": rows}, indent=2))


def conversation(turns: int, *, hints: bool) -> dict:
    def cached(block: dict, control: dict) -> dict:
        return {**block, "cache_control": control} if hints else block

    tools = [
        {"name": name, "description": f"Look up {name}.", "input_schema": {"type": "object", "properties": {}}}
        for name in ("weather", "time", "news")
    ]
    tools[-1] = cached(tools[-1], HOUR)
    system = [cached({"type": "text", "text": "You are a careful agent. " * 40}, HOUR)]
    messages = []
    for turn in range(turns):
        question = {"type": "text", "text": f"Question {turn}: what is the weather in city {turn}? " * 4}
        messages.append({"role": "user", "content": [question]})
        call = {"type": "tool_use", "id": f"t{turn}", "name": "weather", "input": {"city": f"city {turn}"}}
        messages.append({"role": "assistant", "content": [call]})
        result = {"type": "tool_result", "tool_use_id": f"t{turn}", "content": f"Sunny, {turn} degrees. " * 20}
        messages.append({"role": "user", "content": [result]})
    messages[-1]["content"][0] = cached(messages[-1]["content"][0], FIVE_MINUTES)
    messages[-1]["content"].append(cached({"type": "text", "text": "Summarise."}, FIVE_MINUTES))
    return {"model": MODEL, "max_tokens": 16, "system": system, "tools": tools, "messages": messages}


def _medians_ms(runs: list, repeats: int) -> list[float]:
    """Each run's median, the runs taking turns so that a busy machine slows them alike."""
    times: list[list[float]] = [[] for _ in runs]
    for run in runs:
        run()  # warm: tokenizer tables, the library's caches
    for _ in range(repeats):
        for run, each in zip(runs, times):
            start = time.perf_counter()
            run()
            each.append(time.perf_counter() - start)
    return [round(statistics.median(each) * 1000, 2) for each in times]


if __name__ == "__main__":
    main()
