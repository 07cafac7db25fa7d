"""`python -m tests.workers.faulty_worker <worker options>`: the real worker process, with two faults
a test can provoke per request through its stop strings (a tokenizer is needed, --tokenizer):
- DETOKENIZER_FAULT: detokenizing the request's output raises (a bug in one request's processing);
- ENGINE_FAULT: every engine step raises while the request is in the engine (a fault of the engine
  as a whole, which the request brings on wherever it runs).
"""

import sys

from workers.engine.engine import LLMEngine
from workers.engine.output_text import OutputText
from workers.worker.process import main

DETOKENIZER_FAULT = "<detokenizer fault>"
ENGINE_FAULT = "<engine fault>"


def _install_faults() -> None:
    append, step = OutputText.append, LLMEngine.step

    def faulty_append(self: OutputText, token_ids: list[int]) -> str | None:
        if DETOKENIZER_FAULT in self.stops:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "an injected detokenizer fault")
        return append(self, token_ids)

    def faulty_step(self: LLMEngine):
        if any(ENGINE_FAULT in request.params.stop for request in self.requests.values()):
            raise RuntimeError("an injected engine fault")
        return step(self)

    OutputText.append = faulty_append
    LLMEngine.step = faulty_step


if __name__ == "__main__":
    _install_faults()
    main(sys.argv[1:])
