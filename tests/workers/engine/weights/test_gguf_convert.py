import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.workers.engine.weights.conftest import HEAD_DIM, HEADS, KV_HEADS, TinyGguf, llama_cpp_permute
from workers.engine.weights import ModelFiles, load_weights
from workers.engine.weights.gguf_convert import convert_gguf, unpermute_rotary_rows
from workers.protocol.errors import ModelLoadError

CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int) -> None:
    original = np.random.default_rng(num_heads).standard_normal((num_heads * 64, 8), dtype=np.float32)

    restored = unpermute_rotary_rows(llama_cpp_permute(original, num_heads), num_heads)

    np.testing.assert_array_equal(restored, original)


def test_tiny_gguf_converts_to_the_original_float32_weights(tiny_gguf: TinyGguf, tiny_hf_dir: Path) -> None:
    weights = load_file(tiny_hf_dir / "model.safetensors")

    assert set(weights) == set(tiny_gguf.expected_weights)
    for name, expected in tiny_gguf.expected_weights.items():
        assert weights[name].dtype == np.float32, name
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)


def test_tied_embeddings_write_no_lm_head(tiny_hf_dir: Path) -> None:
    config = json.loads((tiny_hf_dir / "config.json").read_text())

    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(tiny_hf_dir / "model.safetensors")


def test_config_reads_as_a_transformers_llama_config(tiny_hf_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_hf_dir)

    assert config.model_type == "llama"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.rms_norm_eps == 1e-5


def test_tiny_weights_equal_transformers_gguf_loading(tiny_gguf: TinyGguf, tiny_hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.path.parent, gguf_file=tiny_gguf.path.name, dtype=torch.float32
    ).state_dict()

    ours = load_file(tiny_hf_dir / "model.safetensors")
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, weight in ours.items():
        np.testing.assert_array_equal(weight, reference[name].numpy(), err_msg=name)


def test_generation_config_stops_on_end_of_turn_tokens(tiny_hf_dir: Path) -> None:
    generation = json.loads((tiny_hf_dir / "generation_config.json").read_text())

    # eos id 2 (<|im_end|>) from the file, plus <|endoftext|> (0), which llama.cpp also stops on.
    assert generation == {"bos_token_id": 1, "eos_token_id": [0, 2], "pad_token_id": 2}


@pytest.mark.parametrize("kept_fraction", [0.0001, 0.5, 0.999])
def test_truncated_gguf_is_reported_and_nothing_is_written(
    tiny_gguf: TinyGguf, tmp_path: Path, kept_fraction: float
) -> None:
    data = tiny_gguf.path.read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[: max(8, int(len(data) * kept_fraction))])
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF") as raised:
        convert_gguf(truncated, out_dir, progress=False)

    assert str(truncated) in str(raised.value)
    assert list(out_dir.iterdir()) == []


def test_a_file_that_is_not_gguf_is_reported(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file")

    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_gguf(not_gguf, tmp_path, progress=False)


def test_unsupported_architecture_is_named(tiny_gguf_factory: Callable[..., TinyGguf], tmp_path: Path) -> None:
    variant = tiny_gguf_factory(architecture="qwen2")

    with pytest.raises(ModelLoadError, match="architecture 'qwen2' is not supported"):
        convert_gguf(variant.path, tmp_path, progress=False)


def test_tensor_without_hf_counterpart_is_named(tiny_gguf_factory: Callable[..., TinyGguf], tmp_path: Path) -> None:
    variant = tiny_gguf_factory(extra_tensor="rope_freqs.weight")

    with pytest.raises(ModelLoadError, match="rope_freqs.weight"):
        convert_gguf(variant.path, tmp_path, progress=False)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loading(
    smollm2_files: ModelFiles, transformers_smollm2: torch.nn.Module
) -> None:
    reference = transformers_smollm2.state_dict()

    ours = dict(load_weights(smollm2_files))

    assert set(ours) == set(reference) - {"lm_head.weight"}
    mismatched = [name for name, weight in ours.items() if not torch.equal(weight, reference[name])]
    assert mismatched == []
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_smollm2_config_equals_transformers_gguf_config(
    smollm2_files: ModelFiles, transformers_smollm2: torch.nn.Module
) -> None:
    reference = transformers_smollm2.config

    assert {field: smollm2_files.config[field] for field in CONFIG_FIELDS} == {
        field: getattr(reference, field) for field in CONFIG_FIELDS
    }
    assert smollm2_files.config["rope_parameters"]["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    # transformers widens the file's float32 epsilon; we write the original config's 1e-05, the same float32.
    assert np.float32(smollm2_files.config["rms_norm_eps"]) == np.float32(reference.rms_norm_eps)
