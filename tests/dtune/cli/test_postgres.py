"""Many hosts, one study: `dtune search` processes share a study through a real PostgreSQL server.

.ci/run starts one (scripts/ci_postgres.sh) and exports its URL as DTUNE_TEST_PG_URL; without it these tests skip
and say so. Every trial is recorded once (none lost, none told twice), the baseline runs once, a process stopped
with Ctrl-C closes its trial as ``interrupted``, and one killed outright has its trial failed by the others'
heartbeat reaper, never left RUNNING; ``--resume`` retries both configs.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from dtune.tune.storage import open_storage

URL = os.environ.get("DTUNE_TEST_PG_URL")
pytestmark = pytest.mark.skipif(
    not URL, reason="no PostgreSQL server: DTUNE_TEST_PG_URL is unset (.ci/run starts one with scripts/ci_postgres.sh)"
)

KERNEL = "fused_recurrent_delta_rule"
# Each test searches its own batch size, so its own study: tests running side by side (pytest -n) never share one.
BATCH = {"tpe": 2, "pattern": 3, "interrupted": 4}


def study_name(batch: int) -> str:
    return f"{KERNEL}:cpu:fp32:T4-B{batch}-H2-HV2-K32-V32"


FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def fresh_study(batch: int) -> None:
    assert URL is not None
    storage = open_storage(URL)
    if study_name(batch) in {s.study_name for s in storage.get_all_studies()}:
        optuna.delete_study(study_name=study_name(batch), storage=storage)


def search(out: Path, batch: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    assert URL is not None
    cmd = [sys.executable, "-m", "dtune.cli.main", "search", "--kernel", KERNEL, "--interpret", "--dtype", "fp32"]
    cmd += ["--seq-lens", "4", "--batch", str(batch), "--head-dims", "32", "--heads", "2"]
    cmd += ["--storage", URL, "--resume", "--json", "--out", str(out), *args]
    return subprocess.Popen(
        cmd, env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def trials(batch: int) -> list[optuna.trial.FrozenTrial]:
    assert URL is not None
    try:
        return optuna.load_study(study_name=study_name(batch), storage=open_storage(URL)).get_trials()
    except KeyError:  # not created yet
        return []


@pytest.mark.parametrize("strategy", ["tpe", "pattern"])
def test_two_processes_one_study(tmp_path: Path, strategy: str) -> None:
    b = BATCH[strategy]
    fresh_study(b)
    args = ("--trials", "4", "--strategy", strategy)
    procs = [search(tmp_path / f"host{i}", b, *args, "--seed", str(i)) for i in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    got = trials(b)
    finished = [t for t in got if t.state in FINISHED]
    assert len(finished) == 8 if strategy == "tpe" else 4 <= len(finished) <= 8  # pattern may reuse results
    assert len({t.number for t in got}) == len(got)  # none told twice
    assert not [t for t in got if t.state in (TrialState.RUNNING, TrialState.WAITING) and t.state != TrialState.WAITING]
    assert sum(bool(t.user_attrs.get("is_default")) for t in got) == 1  # the baseline ran once
    if strategy == "pattern":  # neither process measured a config the other had measured
        measured = [t for t in finished if t.user_attrs.get("reason") != "claimed"]
        keys = [(*sorted(t.params.items()), t.user_attrs.get("kind")) for t in measured]
        assert len(keys) == len(set(keys))


def interrupt_mid_trial(out: Path, env: dict[str, str]) -> tuple[list[optuna.trial.FrozenTrial], bool]:
    """Start a search, send Ctrl-C while a trial is in flight (after two have finished); return the study's trials
    and whether the signal really landed mid-trial (False: the trial seen running had finished just before it)."""
    b = BATCH["interrupted"]
    proc = search(out, b, "--trials", "200", "--strategy", "random", env=env)
    deadline = time.monotonic() + 180
    running: optuna.trial.FrozenTrial | None = None
    while time.monotonic() < deadline and running is None:
        got = trials(b)
        if sum(t.state in FINISHED for t in got) >= 2:  # not between trials: one must be in flight
            running = next((t for t in got if t.state == TrialState.RUNNING), None)
        time.sleep(0.05)
    assert running is not None, "no trial was seen running within 180 s"
    sent = datetime.datetime.now()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    got = trials(b)
    assert not [t for t in got if t.state == TrialState.RUNNING]
    seen = next(t for t in got if t.number == running.number)
    if seen.user_attrs.get("reason") == "interrupted":
        return got, True
    # Not interrupted: only right if it had finished before the signal was sent.
    assert seen.datetime_complete is not None and seen.datetime_complete <= sent, (seen.state, seen.user_attrs)
    return got, False


def test_interrupted_and_killed_processes_leave_nothing_running(tmp_path: Path) -> None:
    b = BATCH["interrupted"]
    beat = {"DTUNE_HEARTBEAT_S": "2", "DTUNE_HEARTBEAT_GRACE_S": "4"}
    # Ctrl-C: the trial in flight is closed as interrupted (tried again if the signal raced the trial's end).
    for attempt in range(3):
        fresh_study(b)
        got, landed = interrupt_mid_trial(tmp_path / f"a{attempt}", beat)
        if landed:
            break
    assert landed, "three Ctrl-Cs in a row landed between trials"
    interrupted = [t for t in got if t.user_attrs.get("reason") == "interrupted"]
    assert len(interrupted) == 1
    deadline = time.monotonic() + 180
    # Killed outright (no chance to close its trial): another process's reaper fails it once its heartbeat is stale.
    proc = search(tmp_path / "b", b, "--trials", "200", "--strategy", "random", "--trial-timeout", "60", env=beat)
    n = len(got)
    while time.monotonic() < deadline and not [t for t in trials(b)[n:] if t.state == TrialState.RUNNING]:
        time.sleep(0.1)
    proc.kill()
    proc.communicate(timeout=60)
    time.sleep(5)  # past the grace period
    later = search(tmp_path / "c", b, "--trials", "1", env=beat)
    _, err = later.communicate(timeout=180)
    assert later.returncode == 0, err.decode()[-2000:]
    got = trials(b)
    assert not [t for t in got if t.state == TrialState.RUNNING]
    stale = [t for t in got if t.state == TrialState.FAIL and t.user_attrs.get("reason") is None]
    assert stale, "the killed process's trial should have been failed by the reaper"
    # --resume retries the configs that never ran to their end (not blocked by their failed trials)
    retried = {tuple(sorted(t.params.items())) for t in got if t.user_attrs.get("source") == "retry"}
    assert {tuple(sorted(t.params.items())) for t in interrupted} <= retried
