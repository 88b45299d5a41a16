"""benchmarks/training_step.py: its grid, its rows (dtune bench's columns, so that dtune report draws them), its
errors and table, and one shape measured end to end under the interpreter."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest
import torch

from dtune.measure.bench import COLUMNS
from dtune.measure.harness import op_run
from dtune.report import data as report_data
from dtune.shape import Gate, Shape
from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def ts() -> ModuleType:
    return load_script("training_step")


def test_the_grid(ts: ModuleType) -> None:
    shapes = ts.parse_shapes("1024,4096,16384,32768,2x512", 32768, 16, [64, 128], Gate.SCALAR)
    got = [(p.B, p.T, p.K) for p in shapes]
    assert got == [(32, 1024, 64), (32, 1024, 128), (8, 4096, 64), (8, 4096, 128), (2, 16384, 64), (2, 16384, 128),
                   (1, 32768, 64), (1, 32768, 128), (2, 512, 64), (2, 512, 128)]  # fmt: skip
    assert all(p.H == p.HV == 16 and p.gate is Gate.SCALAR for p in shapes)


def row(impl: str, ms: float, **extra: Any) -> dict[str, Any]:
    shape = {"kernel": "chunk_gated_delta_rule_bwd", "mode": "fwd+bwd", "dtype": "bf16", "B": 8, "T": 4096, "H": 16}
    shape |= {"HV": 16, "K": 128, "V": 128, "N": 8, "meaningful": True, "peak_mb": 2000.0, "spread_pct": 1.5}
    errs = {f"err_{g}": 3e-3 for g in ("dq", "dk", "dv", "dg", "dbeta", "dh0")} | {"error_grad": 3e-3}
    return {**shape, **errs, "impl": impl, "median_ms": ms, **extra}


def test_rows_are_dtune_bench_s_and_the_report_draws_them(ts: ModuleType, tmp_path: Path) -> None:
    rows = [row("tuned", 2.0, err_dg=6e-3, error_grad=6e-3), row("fla", 3.3), row("flashqla", 1.2)]
    frame = ts.write(rows, tmp_path)
    assert list(frame.columns[: len(COLUMNS)]) == COLUMNS and set(ts.EXTRA) <= set(frame.columns)
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench.json").exists()
    tuned = frame.set_index("impl").loc["tuned"]
    assert tuned["speedup_vs_fla"] == pytest.approx(1.65)  # against fla, not FlashQLA
    data = report_data.load_run(tmp_path)
    vs, against = report_data.versus(data.bench)
    assert against == "fla" and vs is not None and vs["ratio"].tolist() == [pytest.approx(1.65)]
    text = ts.table(frame)
    line = text.splitlines()[1]
    for cell in ("chunk_gated_delta_rule", "B8 T4096", "2.000 (1.5%)", "3.300", "1.65", "1.200", "0.60",
                 "2000/2000", "6.0e-03 / 3.0e-03", "2.00"):  # fmt: skip
        assert cell in line, (cell, line)


def test_table_takes_fla_s_fastest_mode_and_names_failures(ts: ModuleType) -> None:
    rows = [
        row("tuned", 4.0),
        row("fla", 5.0),
        row("fla_fast", 4.4, err_dq=1e-3),
        row("flashqla", math.nan, note="FlashQLA exploded"),
    ]
    frame = ts.frame_of(rows)
    line = ts.table(frame).splitlines()[1]
    assert "4.400 (safe_gate)" in line and "1.10" in line  # 4.4 / 4.0
    assert "3.00" in line  # dtune's dq error over fla_fast's
    assert "FlashQLA exploded" in line


def test_reference_falls_back_to_float32_then_to_none(ts: ModuleType) -> None:
    p = Shape(1, 20, 1, 1, 16, 16, gate=Gate.SCALAR)
    x = op_run("chunk_gated_delta_rule_bwd", p, torch.float32, "cpu").inputs
    est = ts.reference_bytes(p) / 2**30
    ref, kind = ts.reference(x, p, est * 1.01)
    assert kind == "float64" and ref.o.dtype == torch.float64
    ref32, kind = ts.reference(x, p, est * 0.6)
    assert kind == "float32" and ref32.o.dtype == torch.float32
    assert ts.errors(ref32, ref)["error_grad"] < 1e-5  # the float32 reference is exact enough to judge bf16
    none, why = ts.reference(x, p, est * 0.4)
    assert none is None and why.startswith("no errors")


def test_one_shape_end_to_end_under_interpreter(ts: ModuleType) -> None:
    a = argparse.Namespace(peers="fla,flashqla", no_errors=False, ref_max_gib=40.0, rounds=1)
    p = Shape(1, 20, 1, 1, 16, 16, gate=Gate.SCALAR)
    rows = ts.measure("chunk_gated_delta_rule", p, a, torch.device("cpu"), torch.float32)
    assert [r["impl"] for r in rows] == ["tuned"]  # the peers need a GPU: skipped, with notes
    r = rows[0]
    assert r["kernel"] == "chunk_gated_delta_rule_bwd" and r["mode"] == "fwd+bwd" and r["reference"] == "float64"
    assert r["median_ms"] > 0 and r["round_ms"] and not r["meaningful"]
    errs = [r[f"err_{g}"] for g in ("dq", "dk", "dv", "dg", "dbeta", "dh0")]
    assert all(0 <= e < 1e-4 for e in errs) and r["error_grad"] == max(errs)  # fp32: the reference's agreement
    assert '"bwd"' in r["config"] and "fwd: " in r["config_source"]
    assert any("needs a CUDA GPU" in n for n in ts.NOTES)
    frame = ts.frame_of(rows)
    assert list(frame.columns) == [*COLUMNS, *ts.EXTRA] and isinstance(frame, pd.DataFrame)


def test_warm_up_children(ts: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """A peer's warm-up process says why it has nothing to run here; dtune's compiles (the interpreter just runs)."""
    a = argparse.Namespace(shapes="20", batch_tokens=20, heads=1, interpret=True, peers="fla,flashqla", jobs=2)
    ts.warm("flashqla:chunk_gated_delta_rule:16", a)
    ts.warm("dtune:chunk_delta_rule:16:1x20", a)
    out = capsys.readouterr().out
    assert "warm: FlashQLA needs a CUDA GPU: skipped" in out and "warm flashqla:" in out
    assert "warm dtune chunk_delta_rule D16 B1 T20:" in out
