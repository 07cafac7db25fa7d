"""Llama: the decoder as DecoderFamily reads it, with no attention biases unless its config asks."""

from workers.engine.models.family import DecoderFamily


class Llama(DecoderFamily):
    name = "llama"
