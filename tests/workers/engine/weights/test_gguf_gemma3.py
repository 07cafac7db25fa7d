"""A tiny Gemma 3 GGUF converted: llama.cpp's norm offset undone, q/k left unpermuted, the config
transformers reads from the same file, its SentencePiece tokenizer, and the served model's greedy
tokens equal to transformers' on that file."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.workers.engine.weights.tiny_gemma3_gguf import LAYERS, WINDOW, TinyGemma3, write_tiny_gemma3_gguf
from workers.engine import LLM, SamplingParams
from workers.engine.models.registry import model_config
from workers.engine.weights import resolve_model
from workers.engine.weights.gguf_convert import convert_gguf
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma3:
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def converted(tiny: TinyGemma3, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    convert_gguf(tiny.path, directory, progress=False)
    return directory


@pytest.fixture(scope="module")
def transformers_tiny(tiny: TinyGemma3) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name, dtype=torch.float32)
    return model.eval()


def test_weights_are_hf_named_with_the_norm_offset_undone(tiny: TinyGemma3, converted: Path) -> None:
    weights = load_file(converted / "model.safetensors")

    assert set(weights) == set(tiny.expected_weights)
    for name, expected in tiny.expected_weights.items():
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)


def test_weights_equal_transformers_gguf_loading(converted: Path, transformers_tiny: torch.nn.Module) -> None:
    reference = transformers_tiny.state_dict()

    ours = load_file(converted / "model.safetensors")

    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, weight in ours.items():
        np.testing.assert_array_equal(weight, reference[name].numpy(), err_msg=name)


def test_config_is_gemma3_text_with_llama_cpp_fixed_layer_pattern(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())

    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    served = model_config(config)
    assert served.layer_windows == (WINDOW,) * 5 + (None,)
    assert (served.rope.theta, served.sliding_rope.theta) == (1_000_000.0, 10_000.0)
    assert served.attention_scale == 256**-0.5 and served.tie_word_embeddings
    assert len(served.layer_windows) == LAYERS


def test_greedy_tokens_equal_transformers_on_the_same_file(converted: Path, transformers_tiny: torch.nn.Module) -> None:
    # Long enough that the window of 4 hides most of the prompt from the sliding layers.
    prompt = [2, *range(270, 290), 291, 295, 280]
    llm = LLM(converted, seed=0, kv_cache_bytes=1 << 24, max_num_batched_tokens=16)

    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]

    with torch.no_grad():
        reference = transformers_tiny.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert ours.token_ids == reference


def test_sentencepiece_tokenizer_reads_back_through_the_engine_tokenizer(tiny: TinyGemma3, converted: Path) -> None:
    tokenizer = Tokenizer.from_model_files(resolve_model(converted))
    ids = {token: index for index, token in enumerate(tiny.tokens)}

    encoded = tokenizer.encode("the a  é\n<start_of_turn>")

    # BOS added; "th" merges before "he"; two spaces are the "▁▁" piece; é falls back to its UTF-8
    # bytes; the control token stays text unless allowed.
    assert encoded[:8] == [2, ids["th"], ids["e"], ids["▁a"], ids["  "], ids["<0xC3>"], ids["<0xA9>"], ids["\n"]]
    assert ids["<start_of_turn>"] not in encoded
    assert tokenizer.encode("<start_of_turn>", allow_special=True) == [2, ids["<start_of_turn>"]]
    assert tokenizer.decode(encoded) == "the a  é\n<start_of_turn>"
    assert b"".join(tokenizer.token_bytes(token_id) for token_id in encoded[1:7]).decode() == "the a  é"
    assert tokenizer.eos_token_ids == {ids["<eos>"], ids["<end_of_turn>"]}
    streamed = IncrementalDetokenizer(tokenizer)
    assert [streamed.push([token_id]) for token_id in encoded[1:8]] == ["th", "e", " a", "  ", "", "é", "\n"]
