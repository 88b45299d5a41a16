"""Many hosts, one study: `dtune search` processes share a study through a real PostgreSQL server.

.ci/run starts one (scripts/ci_postgres.sh) and exports its URL as DTUNE_TEST_PG_URL; without it these tests skip
and say so. Every trial is recorded once (none lost, none told twice), the baseline runs once, a process stopped
with Ctrl-C closes its trial as ``interrupted``, and one killed outright has its trial failed by the others'
heartbeat reaper, never left RUNNING; ``--resume`` retries both configs.
"""

from __future__ import annotations

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
STUDY = f"{KERNEL}:cpu:fp32:T4-B2-H2-HV2-K32-V32"
FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def fresh_study() -> None:
    assert URL is not None
    storage = open_storage(URL)
    if STUDY in {s.study_name for s in storage.get_all_studies()}:
        optuna.delete_study(study_name=STUDY, storage=storage)


def search(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    assert URL is not None
    cmd = [sys.executable, "-m", "dtune.cli.main", "search", "--kernel", KERNEL, "--interpret", "--dtype", "fp32"]
    cmd += ["--storage", URL, "--resume", "--json", "--out", str(out), *args]
    return subprocess.Popen(
        cmd, env={**os.environ, "TRITON_INTERPRET": "1", **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def trials() -> list[optuna.trial.FrozenTrial]:
    assert URL is not None
    try:
        return optuna.load_study(study_name=STUDY, storage=open_storage(URL)).get_trials()
    except KeyError:  # not created yet
        return []


@pytest.mark.parametrize("strategy", ["tpe", "pattern"])
def test_two_processes_one_study(tmp_path: Path, strategy: str) -> None:
    fresh_study()
    procs = [search(tmp_path / f"host{i}", "--trials", "4", "--seed", str(i), "--strategy", strategy) for i in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    got = trials()
    finished = [t for t in got if t.state in FINISHED]
    assert len(finished) == 8 if strategy == "tpe" else 4 <= len(finished) <= 8  # pattern may reuse results
    assert len({t.number for t in got}) == len(got)  # none told twice
    assert not [t for t in got if t.state in (TrialState.RUNNING, TrialState.WAITING) and t.state != TrialState.WAITING]
    assert sum(bool(t.user_attrs.get("is_default")) for t in got) == 1  # the baseline ran once
    if strategy == "pattern":  # neither process measured a config the other had measured
        measured = [t for t in finished if t.user_attrs.get("reason") != "claimed"]
        keys = [(*sorted(t.params.items()), t.user_attrs.get("kind")) for t in measured]
        assert len(keys) == len(set(keys))


def test_interrupted_and_killed_processes_leave_nothing_running(tmp_path: Path) -> None:
    fresh_study()
    beat = {"DTUNE_HEARTBEAT_S": "2", "DTUNE_HEARTBEAT_GRACE_S": "4"}
    # Ctrl-C: the trial in flight is closed as interrupted.
    proc = search(tmp_path / "a", "--trials", "200", "--strategy", "random", env=beat)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and sum(t.state in FINISHED for t in trials()) < 2:
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    got = trials()
    assert not [t for t in got if t.state == TrialState.RUNNING]
    interrupted = [t for t in got if t.user_attrs.get("reason") == "interrupted"]
    assert len(interrupted) == 1
    # Killed outright (no chance to close its trial): another process's reaper fails it once its heartbeat is stale.
    proc = search(tmp_path / "b", "--trials", "200", "--strategy", "random", "--trial-timeout", "60", env=beat)
    n = len(got)
    while time.monotonic() < deadline and not [t for t in trials()[n:] if t.state == TrialState.RUNNING]:
        time.sleep(0.1)
    proc.kill()
    proc.communicate(timeout=60)
    time.sleep(5)  # past the grace period
    later = search(tmp_path / "c", "--trials", "1", env=beat)
    _, err = later.communicate(timeout=180)
    assert later.returncode == 0, err.decode()[-2000:]
    got = trials()
    assert not [t for t in got if t.state == TrialState.RUNNING]
    stale = [t for t in got if t.state == TrialState.FAIL and t.user_attrs.get("reason") is None]
    assert stale, "the killed process's trial should have been failed by the reaper"
    # --resume retries the configs that never ran to their end (not blocked by their failed trials)
    retried = {tuple(sorted(t.params.items())) for t in got if t.user_attrs.get("source") == "retry"}
    assert {tuple(sorted(t.params.items())) for t in interrupted} <= retried
