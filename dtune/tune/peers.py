"""Other processes on the same study (``--storage`` shared by several searches): what they run, what they claimed
first, and the heartbeats that tell a live process from a dead one.

A planned config another process is running is awaited (:class:`Elsewhere`) instead of run twice: its result is
handed to the strategy when that trial finishes, and the config runs here if it never ran to its end there or takes
more than twice the trial timeout. Two processes that created a trial for the same config at the same moment agree
on the earlier one (:meth:`Peers.claimed_first`). With an RDB storage each process records heartbeats for its open
trials and fails the stale trials of processes that died (:mod:`dtune.tune.storage`); those are retried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from optuna.trial import FrozenTrial, Trial, TrialState

from dtune.tune.bookkeeping import FINISHED, TrialBook, kind_of, params_key, retryable
from dtune.tune.storage import HEARTBEAT_S, reap_stale, record_heartbeats
from dtune.tune.strategy import Candidate, Result

__all__ = ["Elsewhere", "Peers"]


@dataclass
class Elsewhere:
    """A planned config another process is running: its result is awaited instead of running it again."""

    candidate: Candidate
    number: int
    since: float


class Peers:
    """The configs this process awaits from others, and this process's heartbeats."""

    def __init__(self, book: TrialBook, trial_timeout: float) -> None:
        self.book, self.trial_timeout = book, trial_timeout
        self.waiting: list[Elsewhere] = []
        self.last_beat = 0.0

    def running(self, c: Candidate, trials: list[FrozenTrial]) -> int | None:
        """The number of another process's RUNNING trial of ``c``'s config and kind, if any."""
        assert c.params is not None
        k = params_key(c.params)
        for t in trials:
            mine = t.number in self.book.open
            if t.state == TrialState.RUNNING and not mine and params_key(t.params) == k and kind_of(t) == c.kind:
                return t.number
        return None

    def await_result(self, c: Candidate, number: int) -> None:
        """Wait for trial ``number`` of another process to answer ``c``."""
        self.waiting.append(Elsewhere(c, number, time.monotonic()))

    def claimed_first(self, trial: Trial, c: Candidate) -> int | None:
        """The number of an earlier trial of another process for the same planned config (two processes checked the
        study at the same moment and both created one): the later one yields, so no config is measured twice."""
        assert c.params is not None
        k = params_key(c.params)
        for t in self.book.trials():
            if t.number >= trial.number or t.number in self.book.open or params_key(t.params) != k:
                continue
            if kind_of(t) != c.kind:
                continue
            live = t.state == TrialState.RUNNING or (t.state in FINISHED and not retryable(t))
            if live and t.user_attrs.get("reason") != "claimed":
                return t.number
        return None

    def poll(self, trials: list[FrozenTrial]) -> list[Result]:
        """The results other processes finished for the configs awaited; a config whose trial never ran to its end
        there, or ran past twice the trial timeout, comes back as a failure to retry here."""
        by_number = {t.number: t for t in trials}
        out: list[Result] = []
        for e in list(self.waiting):
            t = by_number.get(e.number)
            assert e.candidate.params is not None
            if t is not None and t.state in FINISHED:
                self.waiting.remove(e)
                known = self.book.known(e.candidate, trials)
                if known is not None:
                    out.append(known)
                else:  # it never ran to its end there: run it here
                    out.append(Result(e.candidate, e.candidate.params, False, reason="interrupted"))
            elif time.monotonic() - e.since > 2 * self.trial_timeout:
                self.waiting.remove(e)
                out.append(Result(e.candidate, e.candidate.params, False, reason="timeout"))
        return out

    def beat(self) -> None:
        """Heartbeats of this process's open trials (RDB storages), and the stale trials of dead processes failed."""
        now = time.monotonic()
        if now - self.last_beat < HEARTBEAT_S / 2:
            return
        self.last_beat = now
        record_heartbeats(self.book.study, [p.trial for p in self.book.open.values()])
        reap_stale(self.book.study)
