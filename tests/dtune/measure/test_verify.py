"""dtune verify: the correctness sweep (tiny cases under the interpreter), a planted wrong output, isolation."""

from __future__ import annotations

import json
from pathlib import Path

import dtune.kernels.fused_recurrent as fr
import pytest
import torch
from typer.testing import CliRunner

from dtune.cli.main import app
from dtune.measure import verify as v
from dtune.shape import Gate, Shape

KERNEL = "fused_recurrent_gated_delta_rule"


def test_cases_cover_the_edge_cases() -> None:
    cases = v.default_cases([KERNEL, "chunk_kda"], on_gpu=False)
    assert any(c.shape.T == 1 for c in cases) and any(c.shape.HV == 2 * c.shape.H for c in cases)
    assert any(c.seq_lens and 0 in c.seq_lens for c in cases)  # an empty sequence in a packed batch
    assert any(c.shape.K != c.shape.V for c in cases)
    gpu = v.default_cases(["chunk_kda"], on_gpu=True)
    assert any(c.gate_min == -60.0 for c in gpu) and any(c.config and "SAFE_DIAG" in c.config for c in gpu)
    case = gpu[3]
    assert v.Case.from_json(case.as_json()) == case


def test_verify_cli_passes_under_the_interpreter(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["verify", "-k", KERNEL, "--interpret", "--json", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    assert len(rows) == len(v.recurrent_cases(KERNEL, on_gpu=False)) and all(row["pass"] for row in rows)
    assert (tmp_path / "verify.csv").exists()


def test_a_wrong_output_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fr.forward

    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        o, s = real(*args, **kwargs)
        return o * 1.01, s

    monkeypatch.setattr(fr, "forward", wrong)
    case = v.Case("planted", KERNEL, Shape(2, 9, 1, 1, 16, 16, gate=Gate.SCALAR), "fp32")
    row = v.check(case, "cpu")
    assert not row["pass"] and row["err_o"] > row["tolerance"]
    assert row["err_s"] < row["tolerance"]  # the state is untouched: only the output is off


def test_isolated_case_runs_in_its_own_process() -> None:
    case = v.Case("isolated", KERNEL, Shape(1, 5, 1, 1, 16, 16, gate=Gate.SCALAR), "fp32", config={"BV": 8})
    (row,) = v.run_isolated([case], timeout_s=240)
    assert row["pass"], row
    assert row["err_o"] == pytest.approx(v.check(case, torch.device("cpu"))["err_o"])
