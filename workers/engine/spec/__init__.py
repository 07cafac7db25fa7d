"""Speculative decoding: drafters, the confidence of their drafts and the verification budget."""
