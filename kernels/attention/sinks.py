"""Attention sinks (gpt-oss): one learned logit per query head that joins each row's softmax
denominator as an extra key with no value, so a row may put part of its attention nowhere. Every
backend takes them as `sinks` ([heads], any float dtype; they are added in float32 or the query's
dtype) and checks them here."""

import torch


def check_sinks(sinks: torch.Tensor | None, *, heads: int, device: torch.device) -> None:
    """Raise ValueError unless `sinks` is None or one floating-point logit per query head on `device`."""
    if sinks is None:
        return
    if sinks.shape != (heads,) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be one float logit per query head, shape ({heads},); got {tuple(sinks.shape)} {sinks.dtype}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {device}")
