"""Speculative decoding: drafters propose tokens, the model runner verifies them in one forward."""
