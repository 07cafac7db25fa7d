"""`python -m tests.workers.faulty_worker <worker options>`: the real worker process, with faults a
test can provoke per request. Through its stop strings (a tokenizer is needed, --tokenizer):
- DETOKENIZER_FAULT: detokenizing the request's output raises (a bug in one request's processing);
- ENGINE_FAULT: every engine step raises while the request is in the engine (a fault of the engine
  as a whole, which the request brings on wherever it runs).
Through its prompt, for any model (a request whose prompt holds the token sequence, on whatever
worker computes it: a prefill worker's, a decode worker's once its KV came, a mixed worker's):
- CRASHING_PROMPT: the engine step raises while the request is in the engine, as ENGINE_FAULT;
- SEGFAULTING_PROMPT: the process dies of SIGSEGV in the engine step, reporting nothing.
"""

import os
import resource
import signal
import sys

from workers.engine.engine import LLMEngine
from workers.engine.output_text import OutputText
from workers.worker.process import main

DETOKENIZER_FAULT = "<detokenizer fault>"
ENGINE_FAULT = "<engine fault>"
CRASHING_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
SEGFAULTING_PROMPT = [2, 7, 1, 8, 2, 8, 1, 8]


def _holds(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[start : start + len(sequence)] == sequence for start in range(len(tokens) - len(sequence) + 1))


def _install_faults() -> None:
    append, step = OutputText.append, LLMEngine.step

    def faulty_append(self: OutputText, token_ids: list[int]) -> str | None:
        if DETOKENIZER_FAULT in self.stops:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "an injected detokenizer fault")
        return append(self, token_ids)

    def faulty_step(self: LLMEngine):
        for request in self.requests.values():
            if ENGINE_FAULT in request.params.stop or _holds(request.prompt_token_ids, CRASHING_PROMPT):
                raise RuntimeError("an injected engine fault")
            if _holds(request.prompt_token_ids, SEGFAULTING_PROMPT):
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
                os.kill(os.getpid(), signal.SIGSEGV)
        return step(self)

    OutputText.append = faulty_append
    LLMEngine.step = faulty_step


if __name__ == "__main__":
    _install_faults()
    main(sys.argv[1:])
