"""`make run` until the gateway lands: a few chats through the engine, with timings.

python -m workers.engine.demo [--model NAME_OR_DIR] [--max-tokens N]
"""

import argparse
import time

from workers.engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "Give me three names for a grey cat.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args()

    started = time.perf_counter()
    llm = LLM(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f}s\n")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    results, elapsed = _chat(llm, conversations, params)
    for conversation, result in zip(conversations, results, strict=True):
        print(f"> {conversation[-1]['content']}\n{result.text.strip()}")
        print(f"  [{len(result.token_ids)} tokens, {result.finish_reason}]\n")
    generated = sum(len(r.token_ids) for r in results)
    print(f"batch of {len(results)}: {generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)\n")

    # A second turn repeats the first as its prefix: the engine reuses those KV pages.
    follow_up = conversations[0] + [
        {"role": "assistant", "content": results[0].text},
        {"role": "user", "content": "And of Italy?"},
    ]
    (second,), elapsed = _chat(llm, [follow_up], params)
    print(f"> {follow_up[-1]['content']}\n{second.text.strip()}")
    print(
        f"  [{len(second.prompt_token_ids)} prompt tokens, {second.num_cached_tokens} served from the "
        f"prefix cache, {elapsed:.2f}s]\n"
    )
    print(llm.engine.stats())


def _chat(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> tuple[list, float]:
    prompts = [llm.tokenizer.apply_chat_template(c) for c in conversations]
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    return results, time.perf_counter() - started


if __name__ == "__main__":
    main()
