from workers.engine.weights.registry import find_packaged_model, packaged_model_names


def test_packaged_names_are_case_insensitive() -> None:
    assert find_packaged_model("SmolLM2-135M-Instruct") is find_packaged_model("smollm2-135m-instruct")
    assert find_packaged_model("smollm2-135m-instruct").name == "smollm2-135m-instruct"


def test_unknown_name_is_not_packaged() -> None:
    assert find_packaged_model("gpt-17") is None


def test_packaged_gguf_is_found_without_importing_its_package() -> None:
    path = find_packaged_model("smollm2-135m-instruct").gguf_path()

    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    with path.open("rb") as file:
        assert file.read(4) == b"GGUF"


def test_names_are_listed() -> None:
    assert packaged_model_names() == ("gemma3-270m", "smollm2-135m-instruct")
