"""What every dataset yields: one request to send, and the error a dataset raises when its input is bad."""

from dataclasses import dataclass

import numpy as np


class DatasetError(ValueError):
    """A dataset file or setting that cannot make requests; the message names the file and the fault."""


@dataclass(frozen=True, eq=False)
class BenchRequest:
    prompt_ids: np.ndarray  # the prompt's token ids (int64), sent as-is to /v1/completions
    output_len: int  # max_tokens; with --ignore-eos, the tokens the server generates
    text: str | None = None  # the prompt as text for chat and messages; None until decoded from prompt_ids
    arrival_s: float | None = None  # the dataset's own send time (a trace's timestamp), from its start
    session_id: int | None = None  # requests of one session are sent one after another, in dataset order
