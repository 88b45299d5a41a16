"""benchmarks/record.py on the CPU (--interpret, tiny shapes): one step of three dtune calls merged into one CSV,
the command log, the record's README and the report, the table last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dtune._env import child_env
from tests.benchmarks.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "record.py"


def test_the_decode_step_of_the_record_under_the_interpreter(tmp_path: Path) -> None:
    env = child_env({**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"})
    proc = subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--steps", "decode"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = tmp_path / "record"
    bench = pd.read_csv(record / "decode" / "bench.csv")
    assert sorted(set(bench["kernel"])) == ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule",
                                            "fused_recurrent_kda"]  # fmt: skip
    assert set(bench["impl"]) == {"tuned", "default"} and (bench["T"] == 1).all()
    log = json.loads((record / "commands.json").read_text())
    assert [r["exit"] for r in log] == [0, 0, 0] and all(r["command"].startswith("dtune bench -k fused") for r in log)
    readme = (record / "README.md").read_text()
    assert "| decode | `dtune bench -k fused_recurrent_kda --seq-lens 1" in readme and "dtune report" in readme
    assert (record / "dtune-cpu-report.html").stat().st_size > 10_000
    assert sorted(p.name for p in record.rglob("*") if p.is_file()) == [
        "README.md", "bench.csv", "commands.json", "dtune-cpu-report.html"
    ]  # fmt: skip
    lines = proc.stdout.splitlines()
    assert "x_fla" in lines[-5] and lines[-4].split()[0] == "fused_recurrent_kda" and lines[-1].startswith("0 call")


def test_the_report_runs_in_a_child_that_keeps_the_python_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU image with the charting library installed under PYTHONPATH (pip --target) got no report: the child
    process's path held the checkout alone."""
    record = load_script("record")
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(record.subprocess, "run", lambda cmd, env, **kw: calls.append((cmd, env)))
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    record.build_report(tmp_path, "h100")
    ((cmd, env),) = calls
    assert cmd[-4:] == ["report", str(tmp_path), "-o", str(tmp_path / "dtune-h100-report.html")]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SCRIPT.parents[1]), "/opt/site"]


def test_record_into_writes_the_side_by_side_medians_of_this_gpus_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--record-into: refused (exit 2, nothing run) for a file of another GPU; the benches' medians go into the entries
    they ran as they are (here a bench.csv made by hand: the interpreter's timings are never recorded)."""
    record = load_script("record")
    entry = {"kernel": "chunk_kda", "dtype": "bf16", "bucket": {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 128,
             "V": 128}, "config": {}, "time_ms": 1.0}  # fmt: skip
    other = tmp_path / "h200.json"
    other.write_text(json.dumps({"schema": 1, "gpu": "h200", "entries": [entry]}))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert record.main(["--interpret", "--steps", "decode", "--record-into", str(other)]) == 2
    (tmp_path / "corrupt.json").write_text("{bad")
    assert record.main(["--interpret", "--steps", "decode", "--record-into", str(tmp_path / "corrupt.json")]) == 2
    assert not (tmp_path / "out").exists()
    mine = tmp_path / "cpu.json"
    mine.write_text(json.dumps({"schema": 1, "gpu": "cpu", "entries": [entry]}))
    (tmp_path / "rec" / "forward").mkdir(parents=True)
    rows = [{"kernel": "chunk_kda", "impl": i, "mode": "eager", "dtype": "bf16", "B": 8, "T": 4096, "H": 16, "HV": 16,
             "K": 128, "V": 128, "N": 8, "median_ms": ms, "meaningful": True, "config_match": m, "peak_mb": 1.0}
            for i, ms, m in (("tuned", 0.96, "exact"), ("fla", 1.95, ""), ("fla_fast", 1.56, ""))]  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "rec" / "forward" / "bench.csv", index=False)
    args = record.parse(["--steps", "forward,profile"])
    record.record_into(mine, tmp_path / "rec", args, "cpu")
    (got,) = json.loads(mine.read_text())["entries"]
    assert got["side_by_side_ms"] == {"dtune": 0.96, "fla": 1.56}
    assert got["measured_by"].startswith("side_by_side_ms: the benchmark of record (python benchmarks/record.py")
