import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.workers.engine.weights.conftest import TinyGguf
from workers.engine.weights import ModelFiles, default_cache_dir, load_weights, resolve_model
from workers.engine.weights.loader import MANIFEST_NAME
from workers.protocol.errors import ModelLoadError, UnknownModelError

REPO_ROOT = Path(__file__).resolve().parents[4]


def manifest_of(files: ModelFiles) -> dict:
    return json.loads((files.directory / MANIFEST_NAME).read_text())


def copy_model_dir(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path

    monkeypatch.delenv("SLUICE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "sluice"


def test_hf_directory_resolves_to_its_files(tiny_hf_dir: Path) -> None:
    files = resolve_model(tiny_hf_dir)

    assert files.name == tiny_hf_dir.name
    assert files.directory == tiny_hf_dir
    assert files.config["model_type"] == "llama"
    assert files.weight_files == (tiny_hf_dir / "model.safetensors",)
    assert files.tokenizer_file == tiny_hf_dir / "tokenizer.json"
    assert files.tokenizer_config["eos_token"] == "<|im_end|>"
    assert files.generation_config["eos_token_id"] == [0, 2]


def test_optional_files_may_be_absent(tiny_hf_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_hf_dir / name, tmp_path / name)

    files = resolve_model(tmp_path)

    assert (files.tokenizer_file, files.tokenizer_config, files.generation_config) == (None, {}, {})


def test_load_weights_yields_hf_tensor_names(tiny_hf_dir: Path, tiny_gguf: TinyGguf) -> None:
    weights = dict(load_weights(resolve_model(tiny_hf_dir)))

    assert set(weights) == set(tiny_gguf.expected_weights)
    for name, expected in tiny_gguf.expected_weights.items():
        np.testing.assert_array_equal(weights[name].numpy(), expected, err_msg=name)


def test_sharded_directory_loads_every_shard_in_order(tiny_hf_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "sharded")
    weights = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, model_dir / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    files = resolve_model(model_dir)

    assert files.weight_files == tuple(model_dir / shard for shard in shards)
    assert sorted(name for name, _ in load_weights(files)) == names


def test_shard_index_naming_a_missing_shard_is_reported(tiny_hf_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "sharded")
    index = {"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    with pytest.raises(ModelLoadError, match="model-00009-of-00009.safetensors"):
        resolve_model(model_dir)


def test_directory_without_config_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json") as raised:
        resolve_model(tmp_path)

    assert str(tmp_path) in str(raised.value)


def test_unknown_name_lists_the_known_names() -> None:
    with pytest.raises(UnknownModelError, match="known: gemma3-270m, smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_truncated_safetensors_fails_before_any_tensor_is_yielded(tiny_hf_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_model_dir(tiny_hf_dir, tmp_path / "cut")
    weights_path = model_dir / "model.safetensors"
    os.truncate(weights_path, weights_path.stat().st_size - 100)
    files = resolve_model(model_dir)

    with pytest.raises(ModelLoadError, match="truncated or corrupt") as raised:
        load_weights(files)

    assert str(weights_path) in str(raised.value)


def test_gguf_file_is_converted_once_into_the_cache(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    first = resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=False)
    weights_stat = first.weight_files[0].stat()

    second = resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=False)

    assert second == first
    assert first.name == "tiny-llama"
    assert first.directory == tmp_path / "models" / "tiny-llama"
    assert manifest_of(second) == manifest_of(first)
    assert (second.weight_files[0].stat().st_ino, second.weight_files[0].stat().st_mtime_ns) == (
        weights_stat.st_ino,
        weights_stat.st_mtime_ns,
    )
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == [".tiny-llama.lock", "tiny-llama"]


def test_conversion_shows_progress_on_stderr(
    tiny_gguf: TinyGguf, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=True)

    assert "Converting tiny-llama.gguf" in capsys.readouterr().err


def test_changed_source_is_reconverted(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    source = Path(shutil.copy(tiny_gguf.path, tmp_path / "tiny-llama.gguf"))
    first = manifest_of(resolve_model(source, cache_dir=tmp_path, progress=False))
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))

    second = manifest_of(resolve_model(source, cache_dir=tmp_path, progress=False))

    assert second["conversion_id"] != first["conversion_id"]
    assert second["source"]["mtime_ns"] == stat.st_mtime_ns + 1_000_000_000


def test_corrupt_cache_is_reconverted(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    first = resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=False)
    first_conversion = manifest_of(first)["conversion_id"]
    os.truncate(first.weight_files[0], 1000)

    second = resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=False)

    assert manifest_of(second)["conversion_id"] != first_conversion
    assert len(dict(load_weights(second))) == len(tiny_gguf.expected_weights)


def test_leftovers_of_a_killed_conversion_are_cleared(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    leftover = tmp_path / "models" / ".tiny-llama.partial-k1lled"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")

    resolve_model(tiny_gguf.path, cache_dir=tmp_path, progress=False)

    assert not leftover.exists()


def test_truncated_gguf_leaves_nothing_in_the_cache(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gguf.path.read_bytes()[:5000])
    cache_dir = tmp_path / "cache"

    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF"):
        resolve_model(truncated, cache_dir=cache_dir, progress=False)

    assert [path.name for path in (cache_dir / "models").iterdir()] == [".cut.lock"]


@pytest.mark.slow
def test_packaged_model_second_resolve_is_a_cache_hit(smollm2_files: ModelFiles) -> None:
    weights_mtime = smollm2_files.weight_files[0].stat().st_mtime_ns

    again = resolve_model("SmolLM2-135M-Instruct", progress=False)

    assert again == smollm2_files
    assert again.name == "smollm2-135m-instruct"
    assert manifest_of(again) == manifest_of(smollm2_files)
    assert again.weight_files[0].stat().st_mtime_ns == weights_mtime


CONVERT_AND_REPORT = """
import json, sys
from pathlib import Path
from workers.engine.weights import resolve_model
files = resolve_model("smollm2-135m-instruct", cache_dir=Path(sys.argv[1]), progress=True)
manifest = json.loads((files.directory / "sluice-manifest.json").read_text())
print(json.dumps({"conversion_id": manifest["conversion_id"], "inode": files.weight_files[0].stat().st_ino}))
"""


@pytest.mark.slow
def test_two_processes_converting_at_once_convert_once(tmp_path: Path) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_AND_REPORT, str(tmp_path)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [process.communicate(timeout=300) for process in processes]

    assert [process.returncode for process in processes] == [0, 0], [stderr for _, stderr in results]
    reports = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results]
    assert reports[0] == reports[1]
    assert sum("Converting SmolLM2-135M-Instruct.Q4_1.gguf" in stderr for _, stderr in results) == 1
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == [
        ".smollm2-135m-instruct.lock",
        "smollm2-135m-instruct",
    ]
