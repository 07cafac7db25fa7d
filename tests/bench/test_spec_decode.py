"""bench.spec_decode's command line and prompts: dspark without a cost model and unknown variants are
refused, and every prompt is a chat turn asking for an answer that quotes what it holds."""

import pytest

from bench.spec_decode import CODE, _parse_args, prompts
from workers.engine.weights.loader import resolve_model
from workers.text.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "argv",
    [["--variants", "none,fast"], ["--variants", "none,dspark"], ["--random-weights", "--model", "/tmp/smollm2"]],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(argv)
    assert exit_info.value.code == 2


def test_prompts_quote_their_code_and_passages():
    tokenizer = Tokenizer.from_model_files(resolve_model("smollm2-135m-instruct"))
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts(tokenizer, 12)]

    assert len(texts) == 12 and all(text.startswith("<|im_start|>") for text in texts)
    assert all(code in text for (code, _), text in zip(CODE, texts, strict=False))
    assert any("quoting its key sentences" in text and "We hold these truths" in text for text in texts)
