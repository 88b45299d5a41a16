"""A search process's trial book: a trial that a peer process failed as stale does not kill the search."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from dtune.shape import Shape
from dtune.tune.bookkeeping import TrialBook
from dtune.tune.executor import Evaluated
from dtune.tune.storage import open_storage
from dtune.tune.strategy import Candidate
from dtune.tune.trials import TrialOutcome


def test_a_trial_failed_by_a_peer_as_stale_is_left_failed_and_the_search_goes_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    mine = optuna.create_study(study_name="s", storage=open_storage(url))
    peer = optuna.load_study(study_name="s", storage=open_storage(url))
    book = TrialBook(mine, {"BV": (16, 32)}, "k", Shape(1, 4, 1, 1, 16, 16), "fp32")
    item = book.open_trial(Candidate({"BV": 32}, source="default", is_default=True))
    # the peer's reaping: this process's trial is FAIL in storage before its result arrives
    peer.tell(item.trial.number, state=TrialState.FAIL)
    r = book.finish(item, Evaluated(TrialOutcome(time_ms=1.0)))
    assert not r.ok and r.reason == "interrupted" and not book.open
    (t,) = mine.get_trials()
    assert t.state == TrialState.FAIL  # the peer's verdict stands: --resume retries the config
    # the book goes on: the next trial is recorded and told
    item = book.open_trial(Candidate({"BV": 16}, source="seed"))
    assert book.finish(item, Evaluated(TrialOutcome(time_ms=2.0))).ok
