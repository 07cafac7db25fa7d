"""Model weights: finding a model's files (packaged GGUF or Hugging Face directory) and loading them."""

from workers.engine.weights.loader import ModelFiles, default_cache_dir, load_weights, resolve_model

__all__ = ["ModelFiles", "default_cache_dir", "load_weights", "resolve_model"]
