"""The encode worker's model: the vision tower and connector alone, from an HF directory (against
HF's own, within 1e-5 in fp32) or a config (the same weights as the whole model from that seed)."""

import json

import numpy as np
import pytest
import torch

from tests.workers.engine.hf_idefics3_reference import TINY_IDEFICS3
from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.worker.encoder.conftest import PATCHES_PER_TILE, SETTINGS, picture
from workers.args import EngineArgs
from workers.engine.model_loader import load_model
from workers.engine.models.idefics3 import Idefics3VisionEncoder
from workers.protocol.errors import ModelLoadError
from workers.text.idefics3_images import preprocess_image
from workers.worker.encoder.vision import load_vision_model


def hf_image_embeddings(hf_model, pixel_values: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        features = hf_model.model.get_image_features(torch.from_numpy(pixel_values)[None]).pooler_output
    return torch.cat(features)


def test_a_directory_gives_the_vision_tower_alone_and_hfs_embeddings(hf_model, model_dir):
    model = load_vision_model(EngineArgs(model=model_dir))
    pixels, layout = preprocess_image(picture(60, 44, seed=1), model.settings)

    ours = model.encode(pixels)

    assert isinstance(model.encoder, Idefics3VisionEncoder)
    assert model.name == model_dir.name
    assert model.settings == SETTINGS and layout.num_tiles == 5
    assert (model.patches_per_tile, model.tokens_per_tile) == (PATCHES_PER_TILE, 4)
    assert ours.shape == (5 * 4, 64) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_image_embeddings(hf_model, pixels), atol=1e-5, rtol=1e-5)


def test_a_config_draws_the_vision_weights_the_whole_model_draws(tmp_path):
    config = {**TINY_IDEFICS3, "architectures": ["Idefics3ForConditionalGeneration"]}
    path = tmp_path / "tiny-vlm.json"
    path.write_text(json.dumps(config))

    model = load_vision_model(EngineArgs(model=path, seed=3))
    whole = load_model(path, device=torch.device("cpu"), dtype=torch.float32, seed=3, max_model_len=None)

    assert model.name == whole.name == "tiny-vlm"
    ours, theirs = model.encoder.state_dict(), whole.model.vision.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_text_only_model_is_refused(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(TINY_CONFIGS["llama"]))

    with pytest.raises(ModelLoadError, match="an encode worker serves a vision-language model"):
        load_vision_model(EngineArgs(model=path))


def test_tiles_other_than_the_towers_are_refused(model_dir, tmp_path):
    directory = tmp_path / "other-tiles"
    directory.mkdir()
    for source in model_dir.iterdir():
        (directory / source.name).write_bytes(source.read_bytes())
    (directory / "preprocessor_config.json").write_text(json.dumps({"max_image_size": {"longest_edge": 64}}))

    with pytest.raises(ModelLoadError, match=r"max_image_size.longest_edge \(64\) must be the vision tower's"):
        load_vision_model(EngineArgs(model=directory))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_tower_runs_in_bfloat16_and_hands_back_cpu_tensors(model_dir):
    cpu = load_vision_model(EngineArgs(model=model_dir))
    cuda = load_vision_model(EngineArgs(model=model_dir, device="cuda"))
    pixels, _ = preprocess_image(picture(60, 44, seed=1), cpu.settings)

    ours = cuda.encode(pixels)

    assert (cuda.device.type, ours.device.type, ours.dtype) == ("cuda", "cpu", torch.bfloat16)
    torch.testing.assert_close(ours.float(), cpu.encode(pixels), atol=0.05, rtol=0.05)
