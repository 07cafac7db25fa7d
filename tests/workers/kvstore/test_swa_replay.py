"""The SWA hit policy: the full-attention hit decides the length, the SWA state whether to back off
one block, and the replay mode how far back prefill rebuilds the window."""

import subprocess
import sys

import pytest

from tests.workers.worker_process import REPO_ROOT
from workers.kvstore.swa_replay import EXACT, SwaHit, SwaStateSource, swa_hit

LOCAL, REMOTE, NONE = SwaStateSource.LOCAL, SwaStateSource.REMOTE, SwaStateSource.NONE


@pytest.mark.parametrize("source", [LOCAL, REMOTE])
def test_with_the_state_at_hand_the_whole_hit_is_used_and_nothing_replayed(source: SwaStateSource) -> None:
    hit = swa_hit(5, source, block_tokens=16, window=40)
    assert hit == SwaHit(hit_tokens=80, replay_start=80, source=source)
    assert hit.replayed_tokens == 0


def test_without_it_the_hit_backs_off_a_block_and_replays_the_window_before() -> None:
    hit = swa_hit(5, NONE, block_tokens=16, window=40)
    assert hit == SwaHit(hit_tokens=64, replay_start=64 - 40, source=NONE)
    assert hit.replayed_tokens == 40


def test_a_replay_reaching_past_the_start_starts_at_0() -> None:
    assert swa_hit(2, NONE, block_tokens=16, window=40) == SwaHit(16, 0, NONE)
    assert swa_hit(1, NONE, block_tokens=16, window=40) == SwaHit(0, 0, NONE)


def test_no_hit_is_no_hit_whatever_the_state() -> None:
    assert swa_hit(0, LOCAL, block_tokens=16, window=40) == SwaHit(0, 0, NONE)


def test_exact_replay_covers_the_window_of_every_swa_layer() -> None:
    # Each SWA layer widens what the next one's KV depends on by W - 1 tokens.
    hit = swa_hit(20, NONE, block_tokens=16, window=9, mode=EXACT, num_swa_layers=3)
    assert hit == SwaHit(hit_tokens=304, replay_start=304 - 3 * 8, source=NONE)
    # One SWA layer: the W - 1 tokens its query reads, one fewer than the approximate replay's W.
    one_layer = swa_hit(20, NONE, block_tokens=16, window=9, mode=EXACT, num_swa_layers=1)
    assert one_layer.replay_start == 304 - 8 == swa_hit(20, NONE, block_tokens=16, window=9).replay_start + 1
    assert swa_hit(3, NONE, block_tokens=16, window=9, mode=EXACT, num_swa_layers=5).replay_start == 0


def test_exact_mode_changes_nothing_when_the_state_is_there() -> None:
    assert swa_hit(4, LOCAL, block_tokens=16, window=9, mode=EXACT, num_swa_layers=3) == SwaHit(64, 64, LOCAL)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"mode": "fast"}, "mode"),
        ({"window": 0}, "window"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"num_swa_layers": 0}, "num_swa_layers"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, says: str) -> None:
    settings = {"block_tokens": 16, "window": 9} | kwargs
    with pytest.raises(ValueError, match=says):
        swa_hit(3, NONE, **settings)


def test_the_policy_and_the_holder_index_load_neither_torch_nor_redis() -> None:
    # The entrypoint decides hits with them, and it never loads torch.
    script = (
        "import sys, workers.kvstore.swa_replay, workers.kvstore.holders, workers.kvstore.store\n"
        "print(' '.join(name for name in ('torch', 'redis') if name in sys.modules))"
    )
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == []
