"""Text and tokens: the tokenizer with its chat template, and incremental detokenization; for a
vision-language model, its image preprocessing and placeholder layout, the image content hash, and
how its directory says images go into prompts. Torch-free: the recipe (prompts, responses) and the
engine (stop strings, streamed text, images) both use it."""
