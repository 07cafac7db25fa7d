"""Multi-turn sessions whose every turn extends the one before, like an agent's or chat's history.

Session s, turn k: the prompt of turn k - 1 plus a new chunk of `turn_len` random tokens (turn 0 is a
chunk of `first_turn_len`). No model output is fed back, so each prompt's prefix is exactly the earlier
turn's. Requests are listed turn by turn (every session's turn 0, then every turn 1, ...); the load
loop sends a session's turn only after its previous turn finished.
"""

import numpy as np

from bench.serve.datasets.request import BenchRequest, DatasetError


def multiturn_requests(
    *,
    sessions: int,
    turns: int,
    first_turn_len: int,
    turn_len: int,
    output_len: int,
    ordinary_ids: np.ndarray,
    seed: int,
) -> list[BenchRequest]:
    if min(sessions, turns, first_turn_len, output_len) < 1 or turn_len < 0:
        raise DatasetError("--sessions, --turns, --first-turn-len and --output-len must be >= 1, --turn-len >= 0")
    rng = np.random.default_rng(seed)
    prompts = [rng.choice(ordinary_ids, size=first_turn_len) for _ in range(sessions)]
    requests = []
    for turn in range(turns):
        if turn > 0:
            prompts = [np.concatenate([prompt, rng.choice(ordinary_ids, size=turn_len)]) for prompt in prompts]
        requests += [
            BenchRequest(prompt_ids=prompt, output_len=output_len, session_id=session)
            for session, prompt in enumerate(prompts)
        ]
    return requests
