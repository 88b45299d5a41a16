"""Storages: several processes popping one SQLite study's queue of enqueued trials each get their own trials; an
in-memory SQLite database works in its one process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from dtune.tune.storage import open_storage

QUEUED = 120
ASKERS = 3

ASK = textwrap.dedent(
    """
    import sys, warnings
    import optuna
    from dtune.tune.storage import open_storage
    warnings.simplefilter("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="queue", storage=open_storage(sys.argv[1]))
    print(" ".join(str(study.ask().number) for _ in range(int(sys.argv[2]))))
    """
)


def test_processes_popping_one_sqlite_queue_never_share_a_trial(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for i in range(QUEUED):
        study.enqueue_trial({"x": i})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASK, url, str(QUEUED // ASKERS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(ASKERS)
    ]
    numbers: list[int] = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        numbers += [int(n) for n in out.split()]
    assert len(numbers) == QUEUED
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    assert not twice, f"trials popped by two processes: {twice}"
    states = {t.state for t in optuna.load_study(study_name="queue", storage=open_storage(url)).get_trials()}
    assert states == {optuna.trial.TrialState.RUNNING}  # every queued trial was handed out once


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_in_memory_sqlite_storage_keeps_its_study() -> None:
    """The study's trials run and stay; no heartbeat thread fails on a database of its own (an empty one)."""
    study = optuna.create_study(storage=open_storage("sqlite:///:memory:"))
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=3)
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)
