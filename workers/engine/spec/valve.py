"""Whether speculation pays on this machine, measured: DSpark's second valve.

The budget's valve (budget.best_total) weighs expected accepted tokens against the step-time curve
of the fitted cost model. That curve is the device's; it cannot see what speculating costs around
the device: a verifying step waits for the host (drafting, planning, reading what was accepted),
where a plain decode step overlaps the host's work with the device's under async scheduling. On a
small model those costs can outweigh every accepted draft, and only a measurement shows it.

So the engine alternates windows of steps in two phases, speculating and plain (no drafting, and so
async overlap where the engine has it), and measures each window's output tokens per second from
the time between finished steps. The phase that wins its comparison gets runs twice as long each
time it wins again (up to MAX_RUN steps); the loser is probed for one WINDOW between them, so a
change in the load or the text is noticed within a run. Speculating must beat plain by `margin`.

The engine lets a step run ahead of its tokens only while the phase is plain: the step it schedules
next is then planned before this one is recorded, in the same phase. Rates are totals, not per
request: windows next to each other see about the same batch.
"""

from dataclasses import dataclass

WINDOW = 16  # steps in a probe of the losing phase, and a winner's first run
MAX_RUN = 1024  # steps in the longest run of the winning phase


@dataclass
class _Window:
    steps_left: int
    seconds: float = 0.0
    tokens: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ThroughputValve:
    """Windows alternate: a run of the winning phase, then a WINDOW-long probe of the other. A probe
    that wins makes its phase the winner (its first run WINDOW long); one that loses doubles the
    winner's next run. Until both phases have a rate, speculating is the winner."""

    def __init__(self, *, margin: float, window: int = WINDOW, max_run: int = MAX_RUN) -> None:
        if window < 2:
            raise ValueError(f"a valve window holds at least 2 steps, got {window}")
        self.margin = margin
        self.window = window
        self.max_run = max_run
        self.winner = True  # the phase whose runs the probes interrupt: speculating at first
        self.run = window  # the winner's current run length
        self.drafts = True  # the current window's phase
        self.rates: dict[bool, float | None] = {True: None, False: None}  # by phase, the latest measured
        self._current = _Window(window)

    def record(self, seconds: float, tokens: int) -> None:
        """A finished step: the time since the previous one finished, and the tokens it emitted."""
        window = self._current
        window.seconds += seconds
        window.tokens += tokens
        window.steps_left -= 1
        if window.steps_left <= 0:
            next_drafts = self._decide()
            self.rates[self.drafts] = window.rate()
            self._begin(next_drafts)

    def _decide(self) -> bool:
        """After a winner's run, a probe of the other phase; after a probe, its phase again if it
        beat the winner's last rate (by `margin` when it speculates, by any when it does not), else
        the winner's."""
        if self.drafts == self.winner:
            return not self.winner
        rate, winner_rate = self._current.rate(), self.rates[self.winner]
        spec, plain = (rate, winner_rate) if self.drafts else (winner_rate, rate)
        return spec > plain * (1 + self.margin)

    def _begin(self, drafts: bool) -> None:
        probe_ended = self.drafts != self.winner
        if probe_ended and drafts != self.winner:  # the probe won: its phase runs now
            self.winner, self.run = drafts, self.window
        elif probe_ended:  # the winner won again: a longer run
            self.run = min(self.run * 2, self.max_run)
        self.drafts = drafts
        self._current = _Window(self.run if drafts == self.winner else self.window)
