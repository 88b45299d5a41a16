"""benchmarks/search_quality.py end to end on the CPU (--interpret, tiny shapes): runs, CSVs, the table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from dtune._env import child_env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "search_quality.py"


def test_search_quality_runs_end_to_end_under_the_interpreter(tmp_path: Path) -> None:
    env = child_env({**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"})
    args = ["--interpret", "--kernels", "chunk_delta_rule", "--strategies", "pattern,random", "--budget", "15"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = pd.read_csv(tmp_path / "search_quality_summary.csv")
    assert summary["strategy"].tolist() == ["pattern", "random"]
    assert (summary["completed"] >= 1).all() and summary["vs_best_known"].min() == 1.0
    assert summary["best_known"].str.startswith("best of this script's runs").all()
    curve = pd.read_csv(tmp_path / "search_quality.csv")
    assert {"elapsed_s", "completed", "best_so_far_ms", "best_known_ms", "ratio"} <= set(curve.columns)
    pattern = curve[curve["strategy"] == "pattern"]
    assert pattern["completed"].tolist() == list(range(1, len(pattern) + 1))
    assert pattern["best_so_far_ms"].is_monotonic_decreasing  # best so far never gets worse
    lines = proc.stdout.splitlines()
    assert "best known" in lines[-4] and lines[-3].startswith("chunk_delta_rule") and lines[-1].startswith("done:")
    assert (tmp_path / "runs" / "chunk_delta_rule-pattern" / "trials.csv").exists()
