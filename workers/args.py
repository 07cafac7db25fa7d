"""EngineArgs: every engine setting once — name, type, default, validation, help and command-line flag
— and the dtypes the engine runs in.

The offline `LLM(...)`, the worker (`python -m workers.worker`, `manage.py run_worker`) and
`manage.py serve` all start from an EngineArgs, and workers.engine.factory turns one into an engine.
The command-line options are generated from the fields (`add_engine_arguments`,
`EngineArgs.from_namespace`); `to_argv()` writes settings back as options, which is how `serve`
hands its settings to the workers it starts. The worker's own settings (workers.worker.args) are
defined the same way, with `setting`, `add_setting_arguments` and `setting_argv`.

Torch-free, so the control plane can parse and check engine settings without loading the engine.
"""

import argparse
import dataclasses
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from workers.cost_model import PrefillCostModel

# The dtypes the engine runs models (and so their KV) in, by torch's names.
DTYPES = ("float32", "bfloat16", "float16")
KV_TRANSFERS = ("auto", "zmq")
SWA_REPLAYS = ("approximate", "exact")  # see workers.engine.kv.window_replay
# Weight quantization applied at load: fp8 is DeepSeek-V3's e4m3 with one scale per 128x128 block.
QUANTIZATIONS = ("fp8",)
# KV cache storage: auto keeps the model's dtype; fp8 stores e4m3 values with scales beside them.
KV_CACHE_DTYPES = ("auto", "fp8")
# Speculative decoding: where drafts come from (workers.engine.spec), and how many each step verifies.
SPEC_METHODS = ("none", "ngram", "draft", "mtp")
SPEC_BUDGETS = ("fixed", "dspark")
# Host memory for SWA state: at tens to hundreds of KiB a block, thousands of prefix ends' windows.
SWA_STATE_BYTES = 1 << 30

# The KV cache of an engine off CUDA (the CPU) when neither --num-pages nor --kv-cache-bytes is given.
CPU_KV_CACHE_BYTES = 1 << 30


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    none: str = "",
    flag: str | None = None,
    **argparse_options: Any,
) -> Any:
    """A field of a settings dataclass (EngineArgs, WorkerArgs): its default and what its command-line
    option needs. `none` says what a None or "" default means; `flag` defaults to the name with dashes
    (--max-num-seqs); a bool's flag flips its default."""
    return field(default=default, metadata={"help": help, "none": none, "flag": flag, "options": argparse_options})


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """The settings of one engine; validated on construction (ValueError naming the setting)."""

    model: str | os.PathLike | dict[str, Any] = setting(
        help="packaged model name, Hugging Face directory, or config JSON (random weights from --seed)"
    )
    tokenizer: str | os.PathLike | None = setting(
        None, help="a model name or directory to take the tokenizer from", none="the model's own"
    )
    device: str = setting("cpu", help="torch device to run on")
    dtype: str | None = setting(
        None, help="model and KV dtype", none="float32 on the CPU, bfloat16 on CUDA", choices=DTYPES
    )
    quantization: str | None = setting(
        None,
        choices=QUANTIZATIONS,
        help="quantize the linear layers' weights at load (fp8: e4m3 with one scale per 128x128 block, "
        "DeepSeek-V3's checkpoint format); a checkpoint saved quantized is served as saved whatever this says",
        none="as the checkpoint stores them",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache storage: auto keeps the model's dtype; fp8 stores e4m3 values with their scales, half "
        "the bytes of bf16 (in the device cache, the KV store and the handoff)",
    )
    seed: int = setting(0, help="seed of the sampler, and of the weights of a model built from a config")
    attention_backend: str | None = setting(None, help="attention kernels", none="the device's default")
    page_size: int = setting(16, help="tokens per KV page (a power of two)")
    num_pages: int | None = setting(
        None,
        help="KV pages, whatever the other KV settings say",
        none="sized by --kv-cache-bytes or --gpu-memory-utilization",
    )
    kv_cache_bytes: int | None = setting(
        None,
        help="bytes of KV cache, when --num-pages is not given; given, it also holds on CUDA, where "
        "--gpu-memory-utilization then does not apply",
        none=f"on CUDA, what --gpu-memory-utilization leaves; elsewhere {CPU_KV_CACHE_BYTES >> 30} GiB",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        help="on CUDA, the fraction of the device's total memory this engine may use in all (weights, "
        "activations, CUDA graphs and KV cache): the KV cache gets what the rest leaves of it. Engines "
        "sharing a device each take their own fraction (manage.py serve divides it among its workers). "
        "Applies only when neither --num-pages nor --kv-cache-bytes is given",
    )
    max_num_seqs: int = setting(64, help="requests running at once")
    max_num_batched_tokens: int = setting(2048, help="tokens computed per step")
    max_model_len: int | None = setting(None, help="context window", none="the model's")
    enable_prefix_caching: bool = setting(True, flag="--no-prefix-caching", help="do not reuse cached prefix pages")
    max_waiting: int | None = setting(
        None, help='requests allowed to wait; past it requests are refused as "overloaded"', none="unbounded"
    )
    kv_store: str | os.PathLike | None = setting(None, help="directory of the global KV block store", none="no store")
    kv_store_index: str = setting(
        "memory",
        help='index of the KV store: "memory" (this process\'s own), redis://host:port/db, or ipc://PATH where the '
        "store's GC process serves its index (manage.py run_kv_gc --serve-index)",
    )
    kv_block_tokens: int = setting(128, help="tokens per block of the KV store (a multiple of --page-size)")
    kv_store_max_retained_tokens: int = setting(
        32768,
        help="leading prompt tokens one request's cache hints (cache_control, prompt_cache_retention) may keep "
        "in the KV store; 0 ignores hints",
    )
    kv_store_max_retention_s: float = setting(
        86400.0, help="seconds a cache hint may keep blocks at most (24 h: OpenAI's longest); 0 ignores hints"
    )
    # A path from the command line; from Python, the fitted model itself will do.
    cost_model: str | os.PathLike | PrefillCostModel | None = setting(
        None, help="fitted step-time model JSON (python -m bench.fit_cost_model)", none="none"
    )
    step_budget_ms: float | None = setting(
        None, help="cap each step's predicted time, in milliseconds (needs --cost-model)", none="no cap"
    )
    swa_replay: str = setting(
        "approximate",
        choices=SWA_REPLAYS,
        help="how a hybrid model (sliding-window and full-attention layers) rebuilds its windows' KV before a "
        "prefix hit whose window pages are not cached (a store hit, always): approximate recomputes the "
        "window's tokens before the hit, attending only among them; exact recomputes enough before them "
        "to rebuild the window exactly",
    )
    # A model with sliding-window layers keeps their KV of the blocks it stores in host memory, for later
    # hits here or on other workers (workers.engine.kv.swa_state; a worker serves it to the others).
    swa_state_bytes: int = setting(
        SWA_STATE_BYTES,
        help="host memory for the SWA state of the blocks this engine stores (sliding-window models with a KV "
        "store); 0: keep none, every store hit replays the window",
    )
    enforce_eager: bool = setting(False, help="run the decode forward eagerly instead of replaying CUDA graphs")
    async_scheduling: bool = setting(
        True,
        flag="--no-async-scheduling",
        help="wait for each step before scheduling the next (by default the host schedules step N+1 while "
        "the device runs step N, on the Triton backend)",
    )
    kv_transfer: str = setting(
        "auto",
        choices=KV_TRANSFERS,
        help="how a request's KV moves between workers. auto: workers of one host copy it page to page "
        "(CUDA IPC between GPU processes, shared memory between CPU ones; the KV cache is allocated "
        "shareable), other hosts get it as frames over ZMQ; zmq: always as frames through host memory",
    )
    spec_method: str = setting(
        "none",
        choices=SPEC_METHODS,
        help="speculative decoding's drafter: ngram proposes the tokens that followed the last earlier "
        "occurrence of the request's latest tokens (prompt lookup); draft, the greedy tokens of a smaller "
        "model sharing the target's tokenizer (--spec-draft-model); mtp, DeepSeek-V3's multi-token-prediction "
        "layer, chained (reference path); none decodes one token per step",
    )
    spec_draft_model: str | os.PathLike | dict[str, Any] | None = setting(
        None,
        help="the draft model of --spec-method draft: a packaged name, Hugging Face directory, or config JSON "
        "(random weights, drafting with the target's tokenizer)",
        none="none",
    )
    spec_max_draft_tokens: int = setting(5, help="draft tokens a request verifies per step at most (K)")
    spec_budget: str = setting(
        "fixed",
        choices=SPEC_BUDGETS,
        help="how many drafts each step verifies: fixed, every draft up to --spec-max-draft-tokens; dspark, the "
        "total that maximises expected tokens per second on the fitted step-time curve (needs --cost-model), "
        "split among requests by their drafts' calibrated confidence",
    )
    spec_min_confidence: float = setting(
        0.0,
        help="no draft token is verified whose chance that it and every draft before it are accepted falls "
        "below this, in [0, 1]: the drafter's own probability with the fixed budget, calibrated with dspark",
    )
    ep_size: int = setting(
        1,
        help="expert-parallel ranks: processes that serve a mixture-of-experts model as one worker (attention "
        "data-parallel, experts spread over the ranks)",
    )
    ep_slots_per_rank: int | None = setting(
        None,
        help="expert slots on each EP rank; slots past one per expert hold replicas of experts",
        none="the experts divided by --ep-size, rounded up",
    )

    def __post_init__(self) -> None:
        self._check_speculation()
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be at least 1, got {self.ep_size}")
        if self.ep_slots_per_rank is not None and (self.ep_slots_per_rank < 1 or self.ep_size == 1):
            raise ValueError(f"ep_slots_per_rank must be >= 1 and needs ep_size > 1, got {self.ep_slots_per_rank}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose from {list(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {list(KV_CACHE_DTYPES)}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"unknown kv_transfer {self.kv_transfer!r}; choose from {list(KV_TRANSFERS)}")
        if self.swa_replay not in SWA_REPLAYS:
            raise ValueError(f"unknown swa_replay {self.swa_replay!r}; choose from {list(SWA_REPLAYS)}")
        if self.swa_state_bytes < 0:
            raise ValueError(f"swa_state_bytes must be >= 0, got {self.swa_state_bytes}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (one is reserved), got {self.num_pages}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_block_tokens <= 0 or self.kv_block_tokens % self.page_size:
            raise ValueError(
                f"kv_block_tokens must be a positive multiple of page_size ({self.page_size}), "
                f"got {self.kv_block_tokens}"
            )
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        if self.step_budget_ms is not None and not (self.cost_model and self.step_budget_ms > 0):
            raise ValueError(f"step_budget_ms needs a cost_model and must be positive, got {self.step_budget_ms}")
        if self.kv_store_max_retained_tokens < 0:
            raise ValueError(f"kv_store_max_retained_tokens must be >= 0, got {self.kv_store_max_retained_tokens}")
        if not (math.isfinite(self.kv_store_max_retention_s) and self.kv_store_max_retention_s >= 0):
            raise ValueError(f"kv_store_max_retention_s must be >= 0 and finite, got {self.kv_store_max_retention_s}")

    def _check_speculation(self) -> None:
        if self.spec_method not in SPEC_METHODS:
            raise ValueError(f"unknown spec_method {self.spec_method!r}; choose from {list(SPEC_METHODS)}")
        if self.spec_budget not in SPEC_BUDGETS:
            raise ValueError(f"unknown spec_budget {self.spec_budget!r}; choose from {list(SPEC_BUDGETS)}")
        if self.spec_max_draft_tokens < 1:
            raise ValueError(f"spec_max_draft_tokens must be >= 1, got {self.spec_max_draft_tokens}")
        if not 0 <= self.spec_min_confidence <= 1:
            raise ValueError(f"spec_min_confidence must be in [0, 1], got {self.spec_min_confidence}")
        if self.spec_method == "draft" and self.spec_draft_model is None:
            raise ValueError("spec_method 'draft' needs spec_draft_model: the draft model to propose tokens")
        if self.spec_budget == "dspark" and self.spec_method != "none" and not self.cost_model:
            raise ValueError("spec_budget 'dspark' needs a cost_model: its total comes from the fitted step-time curve")
        if self.spec_method != "none" and self.ep_size > 1:
            raise ValueError(f"spec_method {self.spec_method!r} needs ep_size 1 (not built for expert parallelism yet)")

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "EngineArgs":
        """The settings parsed by a parser that add_engine_arguments set up (other options are ignored)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

    def to_argv(self) -> list[str]:
        """The command-line options that give these settings (those left at their default are left out)."""
        return setting_argv(self)


def default(name: str) -> Any:
    """The default of an engine setting, for code that must agree with it without holding an EngineArgs
    (the router's chunk limit is the engine's default step size)."""
    return EngineArgs.__dataclass_fields__[name].default


def add_engine_arguments(parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None) -> None:
    """One option per EngineArgs field. `defaults` replaces some fields' defaults (a setting with
    no default, such as model, is a required option unless given one here)."""
    defaults = dict(defaults or {})
    names = {f.name: f for f in fields(EngineArgs)}
    if unknown := set(defaults) - names.keys():
        raise ValueError(f"no engine settings named {sorted(unknown)}")
    if flags := [name for name in defaults if names[name].type is bool]:
        raise ValueError(f"{flags}: a flag's default is fixed (the flag flips it)")
    add_setting_arguments(parser.add_argument_group("engine"), EngineArgs, defaults)


def add_setting_arguments(
    group: argparse._ActionsContainer, settings: type, defaults: Mapping[str, Any] | None = None
) -> None:
    """One option per field of a settings dataclass made with `setting` (other fields are skipped),
    `defaults` replacing some of their defaults."""
    defaults = defaults or {}
    for f in _setting_fields(settings):
        value = defaults.get(f.name, f.default)
        options = dict(f.metadata["options"])
        if f.type is bool:
            options["action"] = "store_false" if f.default else "store_true"
            group.add_argument(_flag(f), dest=f.name, help=f.metadata["help"], **options)
            continue
        if value is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = value
        help = f.metadata["help"]
        if value in (None, "") and f.metadata["none"]:
            help += f" (default: {f.metadata['none']})"
        elif value not in (None, "", dataclasses.MISSING):
            help += " (default: %(default)s)"
        group.add_argument(_flag(f), dest=f.name, type=_option_type(f.type), help=help, **options)


def setting_argv(settings: Any) -> list[str]:
    """The command-line options that give a settings dataclass's `setting` fields (those left at their
    default are left out)."""
    argv = []
    for f in _setting_fields(type(settings)):
        value = getattr(settings, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.type is bool:
            argv.append(_flag(f))
            continue
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str | int | float):
            raise ValueError(f"{f.name} cannot be given on a command line: {value!r}")
        argv.append(f"{_flag(f)}={value}")
    return argv


def _setting_fields(settings: type) -> list[dataclasses.Field]:
    return [f for f in fields(settings) if "help" in f.metadata]


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _option_type(annotation: Any) -> type:
    """What the command line gives for a field: the first type of a union (str, int or float)."""
    if isinstance(annotation, types.UnionType):
        annotation = annotation.__args__[0]
    return annotation
