"""The real Gemma 3 270M (optional: `make gemma`): weights, tokenizer and greedy tokens equal to
transformers' own GGUF reader on the same file, past the 512-token window, and English it predicts well."""

import pytest
import torch

from kernels.attention import AttentionMetadata, get_backend
from workers.engine import LLM, SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.model_loader import load_model
from workers.engine.weights import default_cache_dir, load_weights, resolve_model
from workers.engine.weights.registry import find_packaged_model
from workers.protocol.errors import ModelLoadError

GEMMA = "gemma3-270m"


def _installed() -> bool:
    try:
        find_packaged_model(GEMMA).part_paths()
    except ModelLoadError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed(), reason="Gemma 3 270M is an optional extra: `make gemma` installs it"),
]

PARAGRAPH = (
    "The river runs through the old town, past the market and the church, and under seven stone bridges. "
    "In spring the water rises and the fishermen wait on the banks for the floods to pass. "
)
TEXTS = [
    "The capital of France is",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Ça, c'est",
    "def reverse(items):\n    return items[::-1]  # two  spaces\n\n\tand a tab",
    "请用一句话介绍长城。🏯",
    "<b>bold</b> &amp; <table>\n\n\n",
]


@pytest.fixture(scope="module")
def files():
    return resolve_model(GEMMA, progress=False)


@pytest.fixture(scope="module")
def llm(files) -> LLM:
    return LLM(GEMMA, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def transformers_gemma(files) -> torch.nn.Module:
    """transformers' GGUF loader on the joined file: it dequantizes and undoes llama.cpp's norm offset
    independently of our converter."""
    from transformers import AutoModelForCausalLM

    gguf = default_cache_dir() / "gguf" / find_packaged_model(GEMMA).filename
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def test_weights_equal_transformers_gguf_loading(files, transformers_gemma) -> None:
    reference = transformers_gemma.state_dict()

    ours = dict(load_weights(files))

    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert [name for name, weight in ours.items() if not torch.equal(weight, reference[name])] == []


def test_tokenizer_equals_transformers_gguf_tokenizer(llm) -> None:
    from transformers import AutoTokenizer

    gguf = default_cache_dir() / "gguf" / find_packaged_model(GEMMA).filename
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    for text in TEXTS:
        assert llm.tokenizer.encode(text) == reference(text).input_ids, text
        assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text


def test_greedy_equals_transformers_generate_past_the_sliding_window(llm, transformers_gemma) -> None:
    long = llm.tokenizer.encode(PARAGRAPH * 16)  # over 600 tokens: the local layers see only the last 512
    assert len(long) > 600
    prompts = [llm.tokenizer.encode(TEXTS[0]), long]

    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))

    for prompt, result in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            reference = transformers_gemma.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert result.token_ids == reference[0, len(prompt) :].tolist()


def test_english_continuations_are_the_plausible_ones(llm) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    weekdays, opposite, capital = llm.generate(
        [llm.tokenizer.encode(p) for p in ("Monday, Tuesday, Wednesday,", "The opposite of hot is", TEXTS[0])],
        greedy,
    )

    assert weekdays.text == " Thursday"
    assert opposite.text == " cold"
    # The pretrained 270M prefers " the" here (as transformers' model of this file does); " Paris" is
    # among its three best.
    assert " Paris" in [llm.tokenizer.decode([token]) for token, _ in capital.logprobs[0].top]


def test_perplexity_of_an_english_sentence_is_low() -> None:
    # 8.0 measured; the same weights with llama.cpp's q/k permutation left in give 221, with its norm
    # offset left in over 3e7, and a uniform guess over the 262144 tokens 262144.
    sentence = (
        "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are famous for "
        "their museums, their history and their food."
    )
    loaded = load_model(GEMMA, device=torch.device("cpu"), dtype=torch.float32, seed=0, max_model_len=256)
    ids = torch.tensor(loaded.tokenizer.encode(sentence))
    kv = KVCache.for_model(loaded.config, num_pages=3, page_size=16, dtype=torch.float32, device=torch.device("cpu"))
    metadata = AttentionMetadata.build(
        query_lens=[len(ids)], seq_lens=[len(ids)], block_tables=[[1, 2]], page_size=16, device=torch.device("cpu")
    )
    with torch.no_grad():
        hidden = loaded.model(
            ids, torch.arange(len(ids)), kv.layers, [metadata] * len(kv.layers), get_backend("torch_sdpa")
        )
        logprobs = loaded.model.compute_logits(hidden)[:-1].log_softmax(-1)

    perplexity = logprobs.gather(1, ids[1:, None]).mean().neg().exp().item()
    assert perplexity < 20
