"""The held prompts of the real SmolLM2's exactness tests (tests/workers/engine/test_smollm2.py): chats in
several languages and scripts, code, and raw text. The exactness tests compare the engine's greedy
tokens on them with transformers'; bench.perplexity compares each precision variant's with the
unquantized engine's."""

from workers.text.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one, and explain why it is primary."},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a singly linked list."}],
    [{"role": "user", "content": "Explique-moi la photosynthèse en deux phrases, s'il te plaît."}],
    [{"role": "user", "content": "请用一句话介绍长城。🏯"}],
    [{"role": "user", "content": "List the first ten prime numbers, separated by commas."}],
]
RAW_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Ça, c'est",
]


def held_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """The prompts as token ids: the chats through the model's chat template, then the raw texts. A
    model without a chat template (a pretrained one) reads each chat's messages as lines of raw text."""
    if tokenizer.chat_template is None:
        chats = [tokenizer.encode("\n".join(message["content"] for message in c)) for c in CONVERSATIONS]
    else:
        chats = [tokenizer.encode(tokenizer.apply_chat_template(c), allow_special=True) for c in CONVERSATIONS]
    return chats + [tokenizer.encode(text) for text in RAW_PROMPTS]
