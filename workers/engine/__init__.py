"""The inference engine: paged KV, continuous batching, sampling. No Django here.

Names load lazily so that light users (the gateway importing `workers.protocol.errors`, the recipe
importing the tokenizer's errors) do not pull in torch and the whole engine.
"""

import importlib
import os
from typing import TYPE_CHECKING

# MKL's strict AVX2 reproducibility mode keeps one summation order whatever a matmul's row count, on
# AVX-512 CPUs too (there the plain AVX2 mode still rounds some row counts differently, and no padding
# helps), so results are batch-invariant. MKL reads this at its first call, which is why it is set as
# soon as the engine package is imported.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

_EXPORTS = {
    "LLM": "workers.engine.llm",
    "SamplingParams": "workers.protocol.sampling_params",
    "RequestOutput": "workers.engine.outputs",
    "CompletionOutput": "workers.engine.outputs",
    "RequestDelta": "workers.engine.outputs",
    "EngineError": "workers.protocol.errors",
    "EngineOverloadedError": "workers.protocol.errors",
    "InvalidRequestError": "workers.protocol.errors",
    "ModelLoadError": "workers.protocol.errors",
    "UnknownModelError": "workers.protocol.errors",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "UnknownModelError",
]

if TYPE_CHECKING:
    from workers.engine.llm import LLM
    from workers.engine.outputs import CompletionOutput, RequestDelta, RequestOutput
    from workers.protocol.errors import (
        EngineError,
        EngineOverloadedError,
        InvalidRequestError,
        ModelLoadError,
        UnknownModelError,
    )
    from workers.protocol.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'workers.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
