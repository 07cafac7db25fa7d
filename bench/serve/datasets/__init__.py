"""Where a run's requests come from: random prompts, ShareGPT conversations, Mooncake traces and
multi-turn sessions, each a function returning `BenchRequest`s (see the package docstring for flags)."""
