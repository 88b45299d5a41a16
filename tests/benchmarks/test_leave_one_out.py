"""benchmarks/leave_one_out.py: the cases it builds from the shipped file, its summary, and the whole script on the CPU
(--interpret, tiny shapes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest

from dtune._env import child_env
from dtune.borrow import bucket_text
from dtune.store import read_configs
from tests.benchmarks.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "leave_one_out.py"


@pytest.fixture(scope="module")
def loo() -> ModuleType:
    return load_script("leave_one_out")


def test_one_case_per_shipped_bucket(loo: ModuleType) -> None:
    table = read_configs(loo.SHIPPED)
    cases = loo.cases(table, loo.select("forward"))
    forward = [e for e in table.entries if not e.kernel.endswith("_bwd")]
    assert len(cases) == len(forward) >= 26
    assert [c.kernel for c in cases][:4] == ["chunk_delta_rule"] * 4  # the chunk kernels first
    for c in cases:
        assert c.lookup_from.startswith("borrowed: h200.json") and c.bucket["T"] > 0
        assert bucket_text(c.bucket) not in c.lookup_from.split(" (")[0]  # never its own bucket
    packed = [c for c in cases if c.workload.seq_lens is not None]
    assert len(packed) == 3 and all(c.shape.varlen and c.shape.N == 16 and c.shape.T == 52640 for c in packed)
    kda = next(c for c in cases if c.kernel == "chunk_kda" and c.label == "T16384-B2-D128")
    assert kda.lookup["SEG_CHUNKS"] == kda.own["SEG_CHUNKS"] == 64 and "SEG_CHUNKS 16→64" in kda.changes
    every = loo.cases(table, loo.select("all"))
    backward = [c for c in every if c.kernel.endswith("_bwd")]
    entries = [e for e in table.entries if e.kernel.endswith("_bwd")]
    assert len(backward) == len(entries) >= 3
    for c in backward:  # a kernel's only entry hidden: its default; one of several: another borrowed
        alone = sum(e.kernel == c.kernel for e in entries) == 1
        assert c.lookup_from.startswith("default" if alone else "borrowed: h200.json"), (c.kernel, c.lookup_from)
    with pytest.raises(ValueError, match="unknown kernel"):
        loo.select("chunk_nope")


def row(kernel: str, bucket: str, ratio: float, fla_vs: float = math.nan) -> dict[str, Any]:
    return {"kernel": kernel, "bucket": bucket, "lookup_vs_own": ratio, "fla_vs_lookup": fla_vs, "err_lookup": 4e-3}


def test_summary_median_worst_and_fla(loo: ModuleType) -> None:
    rows = [row("a", "x", 1.0, 1.6), row("a", "y", 1.3, 0.9), row("b", "z", 1.05, 1.2), {"kernel": "c", "status": "x"}]
    s = loo.summary(rows)
    assert (s["buckets"], s["timed"], s["with_fla"]) == (4, 3, 3)
    assert s["median_lookup_vs_own"] == pytest.approx(1.05) and s["worst_lookup_vs_own"] == pytest.approx(1.3)
    assert s["worst"] == "a y" and s["slower_than_fla"] == ["a y"]
    assert s["targets"] == {"median <= 1.1": True, "worst <= 1.25": False, "never slower than fla": False}
    text = loo.summary_text(s)
    assert "median 1.050x, worst 1.300x (a y)" in text and "slower than fla on 1 of 3" in text
    no_fla = loo.summary([row("a", "x", 1.0)])
    assert no_fla["targets"]["never slower than fla"] is None and "n/a" in loo.summary_text(no_fla)
    assert loo.summary([]) == {"buckets": 0, "timed": 0}


def test_dry_run_under_the_interpreter(tmp_path: Path) -> None:
    env = child_env({**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"})
    args = ["--interpret", "--kernels", "fused_recurrent_delta_rule,chunk_delta_rule"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frame = pd.read_csv(tmp_path / "leave_one_out.csv")
    assert frame["kernel"].tolist() == ["fused_recurrent_delta_rule"] * 2 + ["chunk_delta_rule"] * 4
    assert set(frame["status"]) <= {"timed", "same config"} and frame["lookup_vs_own"].gt(0).all()
    assert frame.loc[frame["kernel"] == "chunk_delta_rule", "err_lookup"].lt(1e-4).all()  # fp32 vs float64
    info = json.loads((tmp_path / "leave_one_out.json").read_text())
    assert info["summary"]["timed"] == 6 and info["summary"]["targets"]["never slower than fla"] is None
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("6 of 6 buckets timed: lookup / own median")
    assert any(line.startswith("kernel ") and "lookup_vs_own" in line for line in lines)
