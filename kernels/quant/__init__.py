"""Quantized formats and their kernels: FP8 (e4m3) weights with one scale per block, as DeepSeek-V3's
checkpoints store them, and activations quantized per token group."""
