"""A tiny SmolVLM-like model directory that the whole stack serves: the gateway's catalog reads its
tokenizer and image settings, the engine (offline LLM, workers) loads its random weights.

    directory = build_tiny_vlm(tmp_path / "tiny-vlm")
    LLM(directory).generate(prompt_with_image, params, images=[[picture]])

Its tokenizer is SmolLM2's real one (the packaged model's tokenizer.json, with its ChatML chat
template) with SmolVLM's image tokens added as special tokens, so prompts are ChatML prompts that the
recipe renders as for SmolLM2 and user text never becomes an image token. The model is an HF
Idefics3ForConditionalGeneration with a tiny vision tower (tests.workers.engine.hf_idefics3_reference)
and a tiny Llama over that vocabulary, seeded, saved in fp32. Images are resized to a 64-pixel
longest edge and cut into 32-pixel tiles: up to 2 × 2 tiles and the global one, 4 image tokens each.
"""

import json
import shutil
from pathlib import Path

import tokenizers
import torch

from tests.workers.engine.hf_idefics3_reference import TINY_IDEFICS3, build_hf_idefics3
from workers.engine.weights import resolve_model

SMOLLM2 = "smollm2-135m-instruct"
IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
    "<end_of_utterance>",
]
LONGEST_EDGE = 64
TILE_SIDE = 32  # the vision tower's image_size in TINY_IDEFICS3
MAX_POSITIONS = 2048
SEED = 0


def build_tiny_vlm(directory: Path) -> Path:
    """Writes the model into `directory` (created if missing) and returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    smollm2 = resolve_model(SMOLLM2, progress=False)
    tokenizer = tokenizers.Tokenizer.from_file(str(smollm2.tokenizer_file))
    tokenizer.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in IMAGE_TOKENS]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    shutil.copy(smollm2.directory / "tokenizer_config.json", directory / "tokenizer_config.json")
    shutil.copy(smollm2.directory / "generation_config.json", directory / "generation_config.json")

    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    text_config = {**TINY_IDEFICS3["text_config"], "vocab_size": vocab_size, "max_position_embeddings": MAX_POSITIONS}
    model = build_hf_idefics3(
        seed=SEED,
        text_config=text_config,
        image_token_id=tokenizer.token_to_id("<image>"),
        bos_token_id=smollm2.generation_config["bos_token_id"],
        eos_token_id=smollm2.generation_config["eos_token_id"],
    )
    model.to(torch.float32).save_pretrained(directory)
    preprocessor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE},
        "max_image_size": {"longest_edge": TILE_SIDE},
        "do_image_splitting": True,
        "resample": 1,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return directory
