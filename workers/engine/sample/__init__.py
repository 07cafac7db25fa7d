"""Sampling: tokens from logits (temperature, top-p/k, min-p, penalties, seeded draws) and their logprobs."""
