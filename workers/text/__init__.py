"""Text and tokens: the tokenizer with its chat template, and incremental detokenization. Torch-free;
the recipe (prompts, responses) and the engine (stop strings, streamed text) both use it."""
