"""The encode worker's model in patches per second: our SigLIP tower
(workers.engine.models.vision.siglip, inside Idefics3VisionEncoder) against Hugging Face
transformers' SiglipVisionModel carrying the same weights, timed in the same run, at batches of
whole tiles:

    python -m bench.vision_encoder [--device cuda] [--shape so400m] [--batches 1,2,4,8,16,32,64]
        [--repeats 10] [--warmup 3]

Shapes: "so400m" is SigLIP-so400m-patch14-384 (hidden 1152, 27 layers, 16 heads, intermediate 4304,
14-pixel patches, 27 × 27 = 729 patches a tile) with SmolVLM-Instruct's connector (pixel shuffle by 3,
projected to its 2048-wide text model: 81 embeddings a tile). Its tiles are 378 pixels, not 384:
HF's strided convolution drops the 6 pixels past the 27th patch, and our config refuses a patch size
that does not divide the tile (workers.engine.models.idefics3), so 378 gives both towers the
checkpoint's 729 patches and the same work. "tiny" is the test
suite's tiny Idefics3 vision side, for a CPU run. Random weights (seeded; norms and biases perturbed
so that every parameter matters), bfloat16 on CUDA, float32 on the CPU; SDPA attention in both.

The HF model is built first; its tensors go into ours through Idefics3VisionEncoder.load_weights, by
the checkpoint names the model code maps (model.vision_model.*), the connector keeping its own
random weights. Before any timing, both towers encode the same tiles and the largest difference is
printed and checked (exit 1 when over the dtype's tolerance). SiglipVisionModel has no connector, so
the rows time three things: our tower, HF's tower, and our whole encoder (tower + connector, what
an encode worker runs). Each time is the median of `--repeats` calls after `--warmup` calls, each
call bracketed by a device synchronize; the variants alternate within a repeat so drift hits all.
Prints one JSON object: rows per batch and, under "ratios", our tower's throughput over HF's.
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from workers.engine.models.idefics3 import CONNECTOR_PREFIX, VISION_PREFIX, Idefics3VisionEncoder
from workers.engine.models.registry import model_config

BATCHES = (1, 2, 4, 8, 16, 32, 64)
AGREEMENT_TILES = 2
# The towers run the same operations; what differs is summation order inside fused kernels, far
# under these (relative to the largest output) unless a weight landed in the wrong place.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SHAPES = {
    "so400m": {
        "vision": dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=27 * 14,
            patch_size=14,
        ),
        "scale_factor": 3,
        "text_hidden": 2048,
    },
    "tiny": {
        "vision": dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        "scale_factor": 2,
        "text_hidden": 64,
    },
}
VISION_COMMON = dict(num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (bfloat16) or cpu (float32)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="so400m")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated tiles per call")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if any(b < 1 for b in args.batches) or args.repeats < 1 or args.warmup < 0:
        parser.error("--batches and --repeats must be positive and --warmup not negative")
    return args


def idefics3_config(shape: dict) -> dict:
    """An HF-style Idefics3 config of this vision shape; the text side is a stub that only gives the
    connector its output width (the encoder builds no text model)."""
    text_hidden = shape["text_hidden"]
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "vision_config": {**VISION_COMMON, **shape["vision"]},
        "text_config": dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=1,
            num_attention_heads=max(1, text_hidden // 64),
            max_position_embeddings=256,
        ),
        "scale_factor": shape["scale_factor"],
        "image_token_id": 255,
    }


def build_models(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """HF's SiglipVisionModel with random weights, and our encoder loaded with its tensors."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    hf_config = SiglipVisionConfig(**VISION_COMMON, **shape["vision"], vision_use_head=False)
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        hf = SiglipVisionModel(hf_config).to(dtype).eval()
        # transformers 4 keeps the tower under .vision_model; 5 puts its modules on the model itself.
        hf_tower = getattr(hf, "vision_model", hf)
        with torch.no_grad():
            for name, param in hf_tower.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.add_(torch.randn_like(param) * 0.1)
        ours = Idefics3VisionEncoder(model_config(idefics3_config(shape))).to(dtype).eval()
    connector = [(CONNECTOR_PREFIX + n, t) for n, t in ours.connector.state_dict().items()]
    ours.load_weights([*((VISION_PREFIX + n, t) for n, t in hf_tower.state_dict().items()), *connector])
    return hf, ours


def agreement(hf, ours: Idefics3VisionEncoder, tiles: torch.Tensor) -> dict[str, float]:
    with torch.inference_mode():
        reference = hf(pixel_values=tiles).last_hidden_state.float()
        mine = ours.vision_model(tiles).float()
    diff = (mine - reference).abs().max().item()
    scale = reference.abs().max().item()
    return {"max_abs_diff": diff, "max_abs_reference": scale, "relative": diff / scale}


def median_seconds(calls: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int):
    """Median seconds per call of each variant; the variants alternate within every repeat."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for _ in range(warmup):
            for call in calls.values():
                call()
        for _ in range(repeats):
            for name, call in calls.items():
                _synchronize(device)
                started = time.perf_counter()
                call()
                _synchronize(device)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    import transformers

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    hf, ours = build_models(shape, device, dtype, args.seed)
    vision = ours.config.vision
    side = vision.image_size
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)

    def tiles(count: int) -> torch.Tensor:
        return torch.randn(count, 3, side, side, generator=generator, device=device).to(dtype)

    agreed = agreement(hf, ours, tiles(AGREEMENT_TILES))
    agreed["tolerance_relative"] = TOLERANCE[dtype]
    print(f"tower agreement: {json.dumps(agreed)}", file=sys.stderr)
    if not agreed["relative"] <= TOLERANCE[dtype]:
        raise AssertionError(f"our tower and HF's disagree: {agreed}")

    patches_per_tile = vision.patches_per_side**2
    rows = []
    for batch in args.batches:
        pixels = tiles(batch)
        seconds = median_seconds(
            {
                "ours_tower": lambda: ours.vision_model(pixels),
                "hf_tower": lambda: hf(pixel_values=pixels),
                "ours_encoder": lambda: ours(pixels),
            },
            device,
            args.repeats,
            args.warmup,
        )
        patches = batch * patches_per_tile
        row = {"batch_tiles": batch, "patches": patches}
        for name, value in seconds.items():
            row[f"{name}_ms"] = round(value * 1e3, 4)
            row[f"{name}_patches_per_s"] = round(patches / value, 1)
        row["tower_speedup_over_hf"] = round(seconds["hf_tower"] / seconds["ours_tower"], 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    return {
        "benchmark": "vision_encoder",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": args.shape,
        "vision": {
            "hidden_size": vision.hidden_size,
            "num_layers": vision.num_layers,
            "num_heads": vision.num_heads,
            "intermediate_size": vision.intermediate_size,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "patches_per_tile": patches_per_tile,
        },
        "connector": {
            "scale_factor": ours.config.scale_factor,
            "text_hidden": ours.config.hidden_size,
            "embeddings_per_tile": ours.config.image_seq_len,
        },
        "peer": {
            "class": "transformers.SiglipVisionModel",
            "transformers": transformers.__version__,
            "attn_implementation": "sdpa",
        },
        "torch": torch.__version__,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "agreement": agreed,
        "rows": rows,
        "ratios": {"tower_speedup_over_hf": {str(r["batch_tiles"]): r["tower_speedup_over_hf"] for r in rows}},
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda needs a CUDA device; use --device cpu --shape tiny without one", file=sys.stderr)
        return 2
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
