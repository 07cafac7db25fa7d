"""A serving benchmark client: load from a dataset against any OpenAI- or Anthropic-compatible server
(ours or a peer such as vLLM), streamed, with latency, throughput, goodput and prefix-cache hit rates.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct --api-key KEY \\
        [--api completions|chat|messages] [--dataset random|sharegpt|mooncake|multiturn] \\
        [--request-rate R] [--max-concurrency C] [--num-prompts N] [--ignore-eos] \\
        [--slo ttft=500,tpot=50] [--output FILE]

Datasets (every prompt is token ids; chat and messages send them decoded to text by `--tokenizer`):
- random: `--random-input-len`, `--random-output-len`, lengths uniform in len * [1 - r, 1 + r]
  (`--random-range-ratio r`), behind a prefix of `--random-prefix-len` tokens shared by all prompts.
- sharegpt: `--dataset-path` a ShareGPT JSON file; each conversation's first human turn, with the
  answer's token length as output length (`--sharegpt-output-len` fixes it), filtered as vLLM does.
- mooncake: `--dataset-path` a Mooncake JSONL trace; each hash id is a block of `--block-size` (512)
  token ids shared by every request naming it, so the trace's prefix reuse is real. Replayed at its
  timestamps (times `--time-scale`) unless `--request-rate` is given.
- multiturn: `--sessions S --turns T --first-turn-len L0 --turn-len L --output-len O`: turn k of a
  session is its turn k-1 prompt plus L new tokens (L0 + k*L in all), sent once turn k-1 finished;
  `--request-rate` paces the sessions' first turns. DeepSeek's mix scaled down, ~16k-token prompts
  with ~90% of tokens from earlier turns: `--sessions 32 --turns 10 --first-turn-len 14400
  --turn-len 180 --output-len 100`.

Load: `--request-rate` requests/s as a Poisson process (default and `inf`: all at once; a trace's
timestamps for mooncake), at most `--max-concurrency` in flight. Every request streams, with
`max_tokens` the dataset's output length, `temperature` 0 (`--temperature`), usage asked for in the
stream; `--ignore-eos` sends vLLM's `ignore_eos`. Output tokens are counted from usage, else from
text chunks. `--api-key` goes as a Bearer token (OpenAI APIs) or `x-api-key` (messages).

The report, one JSON object on stdout (and in `--output`), a progress bar on stderr:
- `settings`: the dataset, its flags, rates, api, model and base url;
- `completed`, `failed`, `errors` (the first few messages); `duration_s`; request, input and
  output token throughputs (per second; input tokens as the server's usage counts them);
- `ttft_ms`, `tpot_ms` ((e2e - ttft) / (output tokens - 1)), `itl_ms` (gaps between text chunks),
  `e2e_ms`: mean, median, p95, p99;
- `goodput`: requests per second that met every `--slo` objective (ms; ttft, tpot, e2e);
- `prefix_cache`: `server_hit_rate` from the server's Prometheus counters
  (`vllm:prefix_cache_queries_total` / `_hits_total`) before and after the run, null where the
  server has none; `usage_hit_rate`, cached over prompt tokens in the responses' usage;
  `ideal_hit_rate`, what a cache that never evicts could hit, in whole blocks of
  `--cache-block-size` tokens (16: vLLM's default block size and our page size);
- `requests`: one record per request in dataset order (tokens, latencies, ITLs, error).
"""
