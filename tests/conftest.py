"""Session fixtures for the real SmolLM2 model, shared by every suite (each is loaded at most once)."""

import importlib.util
import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (on CPU tensors). Triton reads this when
# it is first imported, so it is set before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from tests.triton_interpreter import patch_interpreter

    patch_interpreter()

import pytest  # noqa: E402

from tests.workers.text.tiny_tokenizer import make_tiny_tokenizer
from tests.zmq_linger import bound_linger
from workers.engine.weights import ModelFiles, resolve_model
from workers.engine.weights.registry import find_packaged_model
from workers.text.tokenizer import Tokenizer

SMOLLM2 = "smollm2-135m-instruct"

bound_linger()


@pytest.fixture(scope="session")
def smollm2_files() -> ModelFiles:
    """The real model, converted once into the default cache ($SLUICE_CACHE_DIR or ~/.cache/sluice)."""
    return resolve_model(SMOLLM2, progress=False)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    """A byte-level tokenizer built in memory (tests.workers.text.tiny_tokenizer)."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_files: ModelFiles) -> Tokenizer:
    return Tokenizer.from_model_files(smollm2_files)


@pytest.fixture(scope="session")
def transformers_smollm2() -> torch.nn.Module:
    """transformers' own GGUF loader on the packaged file (20-35 s): it dequantizes and un-permutes
    independently of our converter, so it is the reference for weights and for outputs."""
    from transformers import AutoModelForCausalLM

    gguf_path = find_packaged_model(SMOLLM2).gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer():
    """transformers' tokenizer built from the packaged GGUF's metadata by its own converter (~7 s)."""
    from transformers import AutoTokenizer

    gguf_path = find_packaged_model(SMOLLM2).gguf_path()
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
