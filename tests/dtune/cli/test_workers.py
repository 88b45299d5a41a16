"""Many workers, one study: two `dtune search` processes share a SQLite storage; no trial lost or doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
from optuna.trial import TrialState

from dtune.tune.storage import open_storage

KERNEL = "fused_recurrent_delta_rule"
STUDY = f"{KERNEL}:cpu:fp32:T4-B2-H2-HV2-K32-V32"


def test_two_workers_one_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dtune.cli.main",
                "search",
                "--kernel",
                KERNEL,
                "--interpret",
                "--dtype",
                "fp32",
                "--trials",
                "4",
                "--storage",
                url,
                "--resume",
                "--seed",
                str(seed),
                "--json",
                "--out",
                str(tmp_path / f"worker{seed}"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed in (1, 2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    trials = optuna.load_study(study_name=STUDY, storage=open_storage(url)).get_trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)]
    seen = [(t.number, t.state.name, t.user_attrs.get("source"), t.user_attrs.get("reason")) for t in trials]
    assert len(finished) == 8, seen  # 4 + 4: none lost
    assert len({t.number for t in finished}) == 8  # none told twice
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert sum(bool(t.user_attrs.get("is_default")) for t in trials) == 1  # the baseline ran once


def test_ctrl_c_keeps_finished_trials(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "dtune.cli.main", "search", "--kernel", KERNEL, "--interpret", "--dtype", "fp32"]
    proc = subprocess.Popen(
        [*cmd, "--trials", "200", "--strategy", "random", "--json", "--out", str(run)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        csv = run / "trials.csv"
        if csv.exists() and len(pd.read_csv(csv)) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    summary = json.loads(out)
    assert summary["interrupted"] is True
    trials = optuna.load_study(study_name=STUDY, storage=open_storage(f"sqlite:///{run / 'study.db'}")).get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]  # the trial in flight was closed
    asked = [t for t in trials if t.state != TrialState.WAITING]  # not the starting configs still queued
    assert len(pd.read_csv(run / "trials.csv")) == len(asked) >= 3
    assert (run / "tuned.json").exists()
