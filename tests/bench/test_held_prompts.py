"""bench.held_prompts: the chats through the model's chat template, or as raw text for a model without one."""

from bench.held_prompts import CONVERSATIONS, RAW_PROMPTS, held_prompts
from tests.workers.text.tiny_tokenizer import make_tiny_tokenizer


def test_chats_go_through_the_chat_template_when_the_model_has_one():
    tokenizer = make_tiny_tokenizer()
    prompts = held_prompts(tokenizer)

    assert len(prompts) == len(CONVERSATIONS) + len(RAW_PROMPTS)
    first = tokenizer.encode(tokenizer.apply_chat_template(CONVERSATIONS[0]), allow_special=True)
    assert prompts[0] == first
    assert prompts[-1] == tokenizer.encode(RAW_PROMPTS[-1])


def test_a_model_without_a_chat_template_reads_each_chats_messages_as_lines_of_text():
    tokenizer = make_tiny_tokenizer(chat_template=None)
    prompts = held_prompts(tokenizer)

    assert len(prompts) == len(CONVERSATIONS) + len(RAW_PROMPTS)
    second = "\n".join(message["content"] for message in CONVERSATIONS[1])
    assert prompts[1] == tokenizer.encode(second)
    assert prompts[len(CONVERSATIONS)] == tokenizer.encode(RAW_PROMPTS[0])
