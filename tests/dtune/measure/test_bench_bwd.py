"""dtune bench's forward + backward mode (a backward kernel, or --mode fwd+bwd) under the interpreter: the training
step of every contestant, gradient errors against float64 autograd, and a contestant whose backward fails keeps its
row with the error's first line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import typer
from typer.testing import CliRunner

from dtune.cli.measure import register
from dtune.measure import bench as b
from dtune.measure.baselines import Impl
from dtune.measure.grad import step_call
from dtune.measure.harness import op_run
from dtune.shape import Gate, Shape, ShapeGrid

TINY = ShapeGrid(seq_lens=(20,), head_dims=(16,), heads=(2,), batch=(1,))


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PassManager::run failed (as fla's backward on triton 3.6)\nsecond line of the error")


def test_forward_backward_rows_check_every_gradient() -> None:
    result = b.run_bench("chunk_gated_delta_rule_bwd", TINY, torch.float32, ["default", "torch"], rounds=1)
    f = result.frame
    assert f["impl"].tolist() == ["tuned", "default", "torch"] and (f["mode"] == "fwd+bwd").all()
    assert (f["kernel"] == "chunk_gated_delta_rule_bwd").all()
    assert (f["error_o"] < 1e-5).all() and (f["error_grad"] < 1e-4).all() and (f["error_grad"] > 0).all()
    assert f["median_ms"].notna().all() and f["peak_mb"].isna().all()  # no CUDA: no peak memory
    fwd = b.run_bench("chunk_gated_delta_rule", TINY, torch.float32, ["default"], rounds=1).frame
    assert (f["flops"] > 2 * fwd["flops"].iloc[0]).all()  # the step's work: forward and backward
    assert fwd["error_grad"].isna().all() and (fwd["mode"] == "eager").all()


def test_a_failing_backward_is_reported_not_skipped() -> None:
    run = op_run("chunk_delta_rule_bwd", Shape(1, 20, 2, 2, 16, 16, gate=Gate.NONE), torch.float32, "cpu")

    def broken(x: dict[str, Any]) -> Any:
        return step_call(lambda xs: (_FailsBackward.apply(xs["v"]), xs["initial_state"] * 1.0), x)

    impls = [Impl("fla", broken), *b.build_impls("chunk_delta_rule_bwd", ["default"], None, "", False)[0]]
    rows = b._shape_rows(run, impls, 1, False)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"fla", "tuned", "default"}
    assert math.isnan(by["fla"]["median_ms"])
    assert by["fla"]["note"] == "RuntimeError: PassManager::run failed (as fla's backward on triton 3.6)"
    assert by["tuned"]["median_ms"] > 0 and by["tuned"]["error_grad"] < 1e-4


def test_cli_mode_fwd_bwd(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    args = ["bench", "-k", "chunk_delta_rule", "--mode", "fwd+bwd", "--interpret", "--dtype", "fp32"]
    args += ["--seq-lens", "20", "--head-dims", "16", "--heads", "2", "--batch", "1", "--baselines", "default"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [(x["kernel"], x["impl"], x["mode"]) for x in rows] == [
        ("chunk_delta_rule_bwd", "tuned", "fwd+bwd"),
        ("chunk_delta_rule_bwd", "default", "fwd+bwd"),
    ]
    assert all(x["error_grad"] < 1e-4 for x in rows)
    r = CliRunner().invoke(app, ["bench", "-k", "fused_recurrent_kda", "--mode", "fwd+bwd", "--interpret"])
    assert r.exit_code == 2 and "has no backward" in r.output
