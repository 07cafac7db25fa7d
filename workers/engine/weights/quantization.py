"""The weight format a model is served in: a checkpoint's Hugging Face `quantization_config`, or the
`--quantization` setting for one saved unquantized.

Served: DeepSeek-V3's FP8, e4m3 weights with one float32 `weight_scale_inv` per (block_n, block_k)
tile and activations quantized at run time per token and 1 x block_k group. Anything else a
checkpoint says it is (another method, e5m2, static activation scales, another block) is refused
here, naming the field, before a byte of it loads.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.engine.dtypes import FP8_E4M3
from workers.protocol.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The tile DeepSeek-V3 saves and the FP8 GEMM kernels are tuned for; --quantization fp8 uses it too.
DEFAULT_BLOCK = (128, 128)
SERVED_BLOCKS = (DEFAULT_BLOCK,)
SCALE_SUFFIX = "_scale_inv"
NOT_CONVERTED_FIELDS = ("modules_to_not_convert", "ignored_layers")


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """Block-scaled e4m3 weights. `not_converted`: full HF module names (e.g. "lm_head" or
    "model.layers.0.mlp") whose linears the checkpoint keeps unquantized; they stay in the model's dtype."""

    block: tuple[int, int] = DEFAULT_BLOCK
    not_converted: tuple[str, ...] = ()
    saved: bool = False  # the checkpoint is saved in it (else --quantization asks for it at load)

    def converts(self, hf_module: str) -> bool:
        """Whether the weights of HF module `hf_module` are quantized: not if it is one the
        checkpoint keeps unquantized, lies under one, or holds one (a layer's experts, one of which
        is listed, all stay unquantized)."""
        return not any(
            hf_module == name or hf_module.startswith(f"{name}.") or name.startswith(f"{hf_module}.")
            for name in self.not_converted
        )


def checkpoint_format(hf_config: dict[str, Any]) -> Fp8Format | None:
    """The format a config's `quantization_config` names (None: none); refuses what is not served."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    if not isinstance(quantization, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {quantization!r}")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(f"unsupported quantization_config.quant_method {method!r}; served: 'fp8'")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"unsupported quantization_config.fmt {fmt!r}; served: 'e4m3'")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelLoadError(f"unsupported quantization_config.activation_scheme {scheme!r}; served: 'dynamic'")
    return Fp8Format(
        block=_block(quantization.get("weight_block_size")), not_converted=_not_converted(quantization), saved=True
    )


def served_format(hf_config: dict[str, Any], requested: str | None) -> Fp8Format | None:
    """The format to serve in: the checkpoint's own if it is saved quantized (whatever `requested`
    says), else `requested` ("fp8": quantize at load in DEFAULT_BLOCK tiles), else None."""
    saved = checkpoint_format(hf_config)
    if saved is not None:
        if requested is not None:
            log.info(
                "the checkpoint is saved in fp8 (block %s): served as saved, --quantization %s has no effect",
                saved.block,
                requested,
            )
        return saved
    if requested is None:
        return None
    if requested != "fp8":
        raise ModelLoadError(f"unknown quantization {requested!r}; served: 'fp8'")
    return Fp8Format()


def weight_dtype_name(fmt: Fp8Format | None, dtype: "torch.dtype") -> str:
    """How the served weights are stored, as the engine reports it: "fp8_e4m3" (off CUDA they are held
    dequantized, but their values are still e4m3 tiles'), else the dtype's name."""
    return FP8_E4M3 if fmt is not None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class BlockQuantized:
    """A checkpoint weight saved quantized: e4m3 `values` [..., N, K] and their tiles' float32 `scale_inv`."""

    values: "torch.Tensor"
    scale_inv: "torch.Tensor"
    block: tuple[int, int]

    @property
    def shape(self) -> "torch.Size":
        return self.values.shape

    def dequantize(self, dtype: "torch.dtype") -> "torch.Tensor":
        from kernels.quant.fp8_blocks import dequantize_weight_blocks

        return dequantize_weight_blocks(self.values, self.scale_inv, self.block, dtype)


def pair_scales(
    weights: Iterator[tuple[str, "torch.Tensor"]], fmt: Fp8Format | None
) -> Iterator[tuple[str, "torch.Tensor | BlockQuantized"]]:
    """The checkpoint's tensors with each e4m3 `X.weight` and its `X.weight_scale_inv` joined into one
    BlockQuantized named `X.weight`; every other tensor as it is. A weight and its scale may lie in
    different shards: whichever comes first waits for the other. A weight without its scale, a scale
    without its weight, or a scale whose shape is not the weight's tile grid is refused, by name."""
    import torch

    from kernels.quant.fp8_blocks import FP8

    waiting_values: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name in waiting_values:
                yield weight_name, _joined(weight_name, waiting_values.pop(weight_name), tensor, fmt)
            else:
                waiting_scales[weight_name] = tensor
        elif tensor.dtype == FP8:
            if fmt is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} is float8_e4m3fn but config.json has no quantization_config"
                )
            if name in waiting_scales:
                yield name, _joined(name, tensor, waiting_scales.pop(name), fmt)
            else:
                waiting_values[name] = tensor
        elif tensor.dtype.is_floating_point and tensor.element_size() == 1:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}; served 8-bit floats: float8_e4m3fn")
        else:
            yield name, tensor
    if waiting_values:
        raise ModelLoadError(
            f"checkpoint lacks the scale of {len(waiting_values)} float8 weights, "
            f"e.g. {sorted(name + SCALE_SUFFIX for name in waiting_values)[:3]}"
        )
    if waiting_scales:
        raise ModelLoadError(
            f"checkpoint has scales of no float8 weight: {sorted(name + SCALE_SUFFIX for name in waiting_scales)[:3]}"
        )


def _joined(name: str, values: "torch.Tensor", scale_inv: "torch.Tensor", fmt: Fp8Format) -> BlockQuantized:
    from kernels.quant.fp8_blocks import block_grid

    expected = (*values.shape[:-2], *block_grid(tuple(values.shape[-2:]), fmt.block))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(
            f"checkpoint tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale_inv.shape)}, expected {expected} "
            f"(one scale per {fmt.block[0]}x{fmt.block[1]} tile of {name!r}, {tuple(values.shape)})"
        )
    return BlockQuantized(values=values, scale_inv=scale_inv.float(), block=fmt.block)


def _block(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in value)
    ):
        raise ModelLoadError(
            f"quantization_config.weight_block_size must be two positive integers [block_n, block_k], got {value!r}"
        )
    block = (value[0], value[1])
    if block not in SERVED_BLOCKS:
        raise ModelLoadError(
            f"unsupported quantization_config.weight_block_size {list(block)}; served: "
            f"{[list(served) for served in SERVED_BLOCKS]}"
        )
    return block


def _not_converted(quantization: dict[str, Any]) -> tuple[str, ...]:
    """The modules saved unquantized: transformers names them modules_to_not_convert, other tools
    ignored_layers; both are honoured."""
    names: list[str] = []
    for field in NOT_CONVERTED_FIELDS:
        listed = quantization.get(field)
        if listed is None:
            continue
        if not isinstance(listed, list) or not all(isinstance(name, str) and name for name in listed):
            raise ModelLoadError(f"quantization_config.{field} must be a list of module names, got {listed!r}")
        names += listed
    return tuple(names)
