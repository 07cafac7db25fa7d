"""Finds a model's files by name or path, and streams its weights.

A packaged model (see `registry`) or a `.gguf` file is converted once into
`<cache_dir>/models/<name>/` and served from there afterwards; a Hugging Face directory is used as is.
A packaged GGUF that ships in parts is first joined into `<cache_dir>/gguf/`.
Finding a model's files loads no torch (the gateway finds its models' tokenizers here): only loading
weights and converting do.
Conversion runs under an exclusive file lock and builds the directory under a temporary name before
renaming it into place, so concurrent processes convert once and never see a half-written directory.
"""

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from workers.engine.weights.registry import PackagedModel, find_packaged_model, packaged_model_names
from workers.kvstore.fsync import fsync_path
from workers.protocol.errors import ModelLoadError, UnknownModelError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MANIFEST_NAME = "sluice-manifest.json"
# The manifest records it: a converted directory from another version of the conversion is redone.
CONVERTER_VERSION = 1
SHARD_INDEX_NAME = "model.safetensors.index.json"
# safetensors' name of float8_e4m3fn, the dtype of a weight saved in FP8 (weights.quantization).
FLOAT8_E4M3 = "F8_E4M3"


@dataclass(frozen=True, slots=True)
class ModelFiles:
    name: str  # served model name: a packaged name, a GGUF file's stem, or the directory's name
    directory: Path  # a Hugging Face-format directory
    config: dict  # parsed config.json
    weight_files: tuple[Path, ...]  # *.safetensors in load order; empty if the directory has none
    tokenizer_file: Path | None  # tokenizer.json if present
    tokenizer_config: dict  # parsed tokenizer_config.json, {} if absent
    generation_config: dict  # parsed generation_config.json, {} if absent


def default_cache_dir() -> Path:
    configured = os.environ.get("SLUICE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "sluice"


def resolve_model(
    name_or_path: str | os.PathLike, *, cache_dir: Path | None = None, progress: bool = True
) -> ModelFiles:
    """A packaged model name wins over a directory of the same name; write `./name` for the directory."""
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    packaged = find_packaged_model(name_or_path) if isinstance(name_or_path, str) else None
    if packaged is not None:
        return _converted(packaged.name, _packaged_gguf(packaged, cache_dir), cache_dir, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _read_model_directory(path.resolve(), name=path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path.stem.lower(), path, cache_dir, progress=progress)
    raise UnknownModelError(
        f"unknown model {os.fspath(name_or_path)!r}: neither a packaged model "
        f"(known: {', '.join(packaged_model_names())}) nor a model directory or .gguf file"
    )


def load_weights(files: ModelFiles) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Opens every weight file before returning, so a bad file fails here, before anything is built."""
    opened = [(path, _open_safetensors(path)) for path in files.weight_files]
    return _tensors(opened)


def float8_tensor_names(files: ModelFiles) -> frozenset[str]:
    """The tensors saved as float8_e4m3fn, from the shards' headers (no tensor is read, no torch loaded)."""
    names = set()
    for path in files.weight_files:
        handle = _open_safetensors(path, framework="numpy")
        names.update(name for name in handle.keys() if handle.get_slice(name).get_dtype() == FLOAT8_E4M3)
    return frozenset(names)


def _tensors(opened: list[tuple[Path, safe_open]]) -> Iterator[tuple[str, "torch.Tensor"]]:
    for path, handle in opened:
        for tensor_name in handle.keys():
            try:
                yield tensor_name, handle.get_tensor(tensor_name)
            except (SafetensorError, OSError) as error:
                raise ModelLoadError(f"{path}: cannot read tensor {tensor_name}: {error}") from error


def _open_safetensors(path: Path, framework: str = "pt") -> safe_open:
    """Opening reads the header and checks that the data it describes is all there; `framework` is
    what its tensors are read as ("numpy" reads none, and loads no torch)."""
    try:
        return safe_open(path, framework=framework)
    except (SafetensorError, OSError) as error:
        size = path.stat().st_size if path.exists() else 0
        raise ModelLoadError(
            f"{path}: unreadable safetensors file ({size} bytes; truncated or corrupt): {error}"
        ) from error


def _read_model_directory(directory: Path, *, name: str) -> ModelFiles:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no config.json, so not a Hugging Face model directory")
    tokenizer_file = directory / "tokenizer.json"
    return ModelFiles(
        name=name,
        directory=directory,
        config=_read_json(config_path),
        weight_files=_weight_files(directory),
        tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
        tokenizer_config=_read_json_if_present(directory / "tokenizer_config.json"),
        generation_config=_read_json_if_present(directory / "generation_config.json"),
    )


def _weight_files(directory: Path) -> tuple[Path, ...]:
    index_path = directory / SHARD_INDEX_NAME
    if not index_path.is_file():
        return tuple(sorted(directory.glob("*.safetensors")))
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index_path}: no 'weight_map' object")
    files = tuple(directory / shard for shard in sorted(set(weight_map.values())))
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise ModelLoadError(f"{index_path}: lists shards that do not exist: {', '.join(missing)}")
    return files


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: unreadable JSON: {error}") from error
    if not isinstance(content, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(content).__name__}")
    return content


def _read_json_if_present(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}


def _cache_subdir(cache_dir: Path, name: str) -> Path:
    directory = cache_dir / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelLoadError(f"cannot create the model cache {directory} (set SLUICE_CACHE_DIR): {error}") from error
    return directory


def _packaged_gguf(packaged: PackagedModel, cache_dir: Path) -> Path:
    """The packaged GGUF file; one that ships in parts is joined once, checked against its sha256."""
    if not packaged.is_split:
        return packaged.gguf_path()
    parts = packaged.part_paths()
    directory = _cache_subdir(cache_dir, "gguf")
    target = directory / packaged.filename
    with _exclusive_lock(directory / f".{packaged.filename}.lock"):
        if not _joined_from(target, parts):
            _join_into_place(parts, target, sha256=packaged.sha256, name=packaged.name)
    return target


def _joined_from(target: Path, parts: list[Path]) -> bool:
    """Whether `target` was joined from these parts as installed now. Joining renames a whole file into
    place, so one of the parts' total size is whole; parts installed since (a reinstall) are newer."""
    if not target.is_file():
        return False
    joined = target.stat()
    installed = [part.stat() for part in parts]
    return joined.st_size == sum(part.st_size for part in installed) and all(
        part.st_mtime_ns <= joined.st_mtime_ns for part in installed
    )


def _join_into_place(parts: list[Path], target: Path, *, sha256: str | None, name: str) -> None:
    logger.info("joining the %d parts of %s into %s (once)", len(parts), name, target)
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex}")
    digest = hashlib.sha256()
    try:
        with staging.open("wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"model {name!r}: its joined parts have sha256 {digest.hexdigest()}, expected {sha256} "
                f"(reinstall its packages; parts: {', '.join(str(part) for part in parts)})"
            )
        staging.chmod(0o644)
        fsync_path(staging)
        os.replace(staging, target)
        fsync_path(target.parent)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _converted(name: str, gguf_path: Path, cache_dir: Path, *, progress: bool) -> ModelFiles:
    models_dir = _cache_subdir(cache_dir, "models")
    target = models_dir / name
    source = _source_record(gguf_path)
    with _exclusive_lock(models_dir / f".{name}.lock"):
        cached = _valid_conversion(target, name=name, source=source)
        if cached is not None:
            return cached
        _convert_into_place(gguf_path, target, source=source, progress=progress)
        return _read_model_directory(target, name=name)


def _source_record(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so a crashed converter never wedges the cache.
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _valid_conversion(target: Path, *, name: str, source: dict) -> ModelFiles | None:
    """The cached directory if it was converted from this very source and its weights open; else None."""
    if not target.exists():
        return None
    try:
        manifest = _read_json(target / MANIFEST_NAME)
        if manifest.get("converter_version") != CONVERTER_VERSION or manifest.get("source") != source:
            logger.info("reconverting %s: its source or the converter changed", target)
            return None
        files = _read_model_directory(target, name=name)
        if not files.weight_files:
            raise ModelLoadError(f"{target}: no weight files")
        for path in files.weight_files:
            _open_safetensors(path, framework="numpy")
    except ModelLoadError as error:
        logger.warning("reconverting %s: the cached copy is unusable: %s", target, error)
        return None
    return files


def _convert_into_place(gguf_path: Path, target: Path, *, source: dict, progress: bool) -> None:
    logger.info("converting %s into %s (once; later starts load the converted copy)", gguf_path, target)
    _remove_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    # mkdtemp makes the directory private; the converted model is shared by every user of the cache.
    staging.chmod(0o755)
    from workers.engine.weights.gguf_convert import convert_gguf  # torch: only a conversion needs it

    try:
        convert_gguf(gguf_path, staging, progress=progress)
        manifest = {"converter_version": CONVERTER_VERSION, "source": source, "conversion_id": uuid.uuid4().hex}
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        for path in staging.iterdir():
            path.chmod(0o644)
        _fsync_directory_files(staging)
        if target.exists():
            retired = target.with_name(f".{target.name}.retired-{uuid.uuid4().hex}")
            os.rename(target, retired)
            os.rename(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _remove_leftovers(target: Path) -> None:
    # Only a converter that died mid-way leaves these; under the lock no live one can own them.
    for pattern in (f".{target.name}.partial-*", f".{target.name}.retired-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_directory_files(directory: Path) -> None:
    for path in directory.iterdir():
        fsync_path(path)
    fsync_path(directory)
