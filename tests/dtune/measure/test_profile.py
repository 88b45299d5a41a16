"""dtune profile: stages from a plan, kernel resources, floors, the ncu command; end to end under the interpreter."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import typer
from typer.testing import CliRunner

from dtune.cli.measure import register
from dtune.measure import profile as pr
from dtune.measure import work as roofline
from dtune.measure.error import rel_rms_error
from dtune.measure.resources import Resources, resources_of
from dtune.shape import Gate, Shape

ROOFS = roofline.Roofs(gbs=4000.0, tflops=700.0, source="test")


def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_kernel_resources() -> None:
    compiled = types.SimpleNamespace(n_regs=96, n_spills=2, metadata=types.SimpleNamespace(shared=49152))
    assert resources_of([compiled]) == Resources(registers=96, spills=2, shared_mem=49152)
    assert resources_of([types.SimpleNamespace(n_regs=64, metadata={"shared": 1024})]).shared_mem == 1024
    assert resources_of([None]) == (None, None, None)


@dataclass
class FakeStage:
    name: str
    flops: float
    bytes: float
    calls: list[str]

    def run(self) -> Any:
        self.calls.append(self.name)
        return types.SimpleNamespace(n_regs=128, n_spills=0, metadata=types.SimpleNamespace(shared=32768))


def test_chunk_profile_uses_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler follows the plan() contract: one row per stage, with its resources and its own work."""
    calls: list[str] = []
    seen: dict[str, Any] = {}

    def fake_plan(q: Any, k: Any, v: Any, g: Any, beta: Any, gate: str, scale: float, h0: Any, fs: bool, cu: Any,
                  config: dict[str, Any]) -> tuple[list[FakeStage], Any]:  # fmt: skip
        seen.update(gate=gate, scale=scale, config=config, cu=cu)
        return [FakeStage("intra", 4e6, 2e6, calls), FakeStage("state", 1e6, 3e6, calls)], (None, None)

    import dtune.kernels.chunk as chunk

    monkeypatch.setattr(chunk, "plan", fake_plan)
    p = Shape(B=1, T=32, H=2, HV=2, K=16, V=16, N=1, gate=Gate.SCALAR)
    res = pr.run_profile("chunk_gated_delta_rule", p, torch.float32, roofs=ROOFS, device="cpu")
    f = res.frame.set_index("stage")
    assert list(f.index) == ["intra", "state", pr.TOTAL]
    assert seen["gate"] == "scalar" and seen["scale"] == pytest.approx(16**-0.5) and seen["cu"] is None
    assert seen["config"]["BT"] in (16, 32, 64, 128)  # the full, checked config
    assert calls.count("intra") >= 2  # compile run + timed runs
    intra = f.loc["intra"]
    assert (intra["registers"], intra["spills"], intra["shared_mem"]) == (128, 0, 32768)
    assert intra["flops"] == 4e6 and intra["bytes"] == 2e6 and intra["intensity"] == 2.0
    assert intra["floor_ms"] == pytest.approx(max(2e6 / 4e12, 4e6 / 7e14) * 1e3)
    assert intra["bound"] == "memory" and "× floor, memory-bound" in intra["verdict"]
    assert intra["x_floor"] == pytest.approx(intra["median_ms"] / intra["floor_ms"])
    assert intra["pct_bandwidth"] == pytest.approx(100 * intra["gbs"] / 4000.0)
    assert intra["pct_matmul"] == pytest.approx(100 * intra["tflops"] / 700.0)
    assert f.loc[["intra", "state"], "share"].sum() == pytest.approx(1.0)
    assert math.isnan(f.loc[pr.TOTAL, "share"])
    total_work = roofline.work("chunk_gated_delta_rule", p, torch.float32)
    assert f.loc[pr.TOTAL, "flops"] == total_work.flops
    assert (f["roof_gbs"] == 4000.0).all() and (f["roof_source"] == "test").all()


def test_fused_recurrent_profile_end_to_end(tmp_path: Path) -> None:
    p = Shape(B=2, T=1, H=2, HV=2, K=16, V=16, N=2, gate=Gate.CHANNEL)
    res = pr.run_profile("fused_recurrent_kda", p, torch.bfloat16)
    f = res.frame
    assert list(f.columns) == pr.COLUMNS
    assert f["stage"].tolist() == ["fused_recurrent_kda", pr.TOTAL]
    assert f["median_ms"].gt(0).all() and not f["meaningful"].any()
    assert f["share"].iloc[0] == 1.0
    # decode: the state read and written in float32 is part of the compulsory bytes
    assert f["bytes"].iloc[0] == roofline.io_bytes(p, torch.bfloat16, True, True)
    assert f["bytes"].iloc[0] >= 8 * 2 * 2 * 16 * 16
    assert any("NOT meaningful" in n for n in res.notes) and any("ceilings not measured" in n for n in res.notes)
    csv_path, json_path = pr.write(res, tmp_path)
    assert pd.read_csv(csv_path)["stage"].tolist() == f["stage"].tolist()
    assert len(json.loads(json_path.read_text())) == 2


def test_chunk_profile_end_to_end_under_interpreter(tmp_path: Path) -> None:
    """The real chunk pipeline (kernels/chunk), split into its stages, on a tiny shape."""
    p = Shape(B=1, T=32, H=1, HV=1, K=16, V=16, N=1, gate=Gate.CHANNEL)
    res = pr.run_profile("chunk_kda", p, torch.float32, roofs=ROOFS)
    stages = res.frame["stage"].tolist()
    assert len(stages) >= 2 and stages[-1] == pr.TOTAL
    assert res.frame["median_ms"].gt(0).all()
    assert res.frame["flops"].gt(0).all() and res.frame["bytes"].gt(0).all()
    # the op the profile times computes the right thing (a zeroed or unwritten output shows here)
    assert res.frame.set_index("stage").loc[pr.TOTAL, "error_o"] < 1e-4


def test_ncu_command(tmp_path: Path) -> None:
    p = Shape(B=8, T=4096, H=16, HV=16, K=128, V=128, N=8, gate=Gate.CHANNEL)
    cmd = pr.ncu_command("chunk_kda", p, torch.bfloat16, {"BT": 64}, tmp_path)
    assert cmd[0] == "ncu" and "--set" in cmd and "--export" in cmd
    assert cmd[cmd.index("--export") + 1] == str(tmp_path / "ncu_chunk_kda_T4096_D128")
    assert cmd[-4:-1] == [sys.executable, "-m", "dtune.measure.profile"]
    spec = json.loads(cmd[-1])
    assert (spec["kernel"], spec["T"], spec["K"], spec["dtype"], spec["config"]) == (
        "chunk_kda",
        4096,
        128,
        "bf16",
        {"BT": 64},
    )


def test_launch_spec_runs_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ncu profiles: the spec's kernel, shape, dtype and config, launched ``repeats`` times, right each time."""
    from dtune.kernels.reference import naive_recurrent

    import dtune.ops

    calls: list[tuple[str, Any, Any]] = []
    real = dtune.ops.run_kernel

    def spy(kernel: str, *args: Any, **kw: Any) -> Any:
        out = real(kernel, *args, **kw)
        calls.append((kernel, kw, out))
        return out

    monkeypatch.setattr(dtune.ops, "run_kernel", spy)
    p = Shape(B=2, T=3, H=1, HV=2, K=16, V=8, N=2, gate=Gate.SCALAR)
    pr._launch(pr.launch_spec("fused_recurrent_gated_delta_rule", p, torch.float32, {"BV": 8}), repeats=2)
    assert len(calls) == 2
    kernel, kw, (o, s) = calls[0]
    assert kernel == "fused_recurrent_gated_delta_rule" and kw["config"] == {"BV": 8, "num_warps": 1, "num_stages": 1}
    q, k, v, g, beta = (kw[n] for n in ("q", "k", "v", "g", "beta"))
    assert o.shape == (2, 3, 2, 8) and o.dtype == torch.float32
    ref, ref_s = naive_recurrent(q, k, v, g, beta, kw["scale"], kw["initial_state"], True)
    assert rel_rms_error(o, ref) < 1e-5 and s is not None and rel_rms_error(s, ref_s) < 1e-5


def test_profile_cli_json_and_ncu_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "ncu" else real_which(name, *a, **k))
    args = [
        "profile",
        "--kernel",
        "fused_recurrent_delta_rule",
        "--head-dim",
        "16",
        "--heads",
        "1",
        "--out",
        str(tmp_path),
    ]
    r = CliRunner().invoke(cli(), [*args, "--json", "--ncu"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [row["stage"] for row in out["rows"]] == ["fused_recurrent_delta_rule", pr.TOTAL]
    assert "not on PATH" in out["ncu"] and "dtune.measure.profile" in out["ncu"]
    assert (tmp_path / "profile.csv").exists()
    r = CliRunner().invoke(cli(), args)
    assert r.exit_code == 0 and "dtune profile" in r.output


def test_profile_cli_defaults_to_the_largest_tuned_shape(tmp_path: Path) -> None:
    entries = [
        {"kernel": "fused_recurrent_kda", "dtype": "bf16", "bucket": dict(T=t, B=b, H=1, HV=1, K=16, V=16),
         "config": {"BV": 8}} for t, b in ((1, 1), (4, 2), (2, 1))
    ]  # fmt: skip
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"schema": 1, "gpu": "cpu", "entries": entries}))
    args = ["profile", "--kernel", "fused_recurrent_kda", "--config", str(tuned), "--out", str(tmp_path), "--json"]
    r = CliRunner().invoke(cli(), args)
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["rows"][0]
    assert (row["B"], row["T"], row["K"]) == (2, 4, 16)
    assert json.loads(row["config"])["BV"] == 8


def test_stage_resources_come_from_the_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused-recurrent op returns no kernel: the launches it makes are captured (as in the trials)."""
    from triton.runtime.jit import JITFunction

    compiled = iter(
        [
            types.SimpleNamespace(n_regs=72, n_spills=1, metadata=types.SimpleNamespace(shared=0)),
            types.SimpleNamespace(n_regs=40, n_spills=2, metadata={"shared": 4096}),
        ]
    )
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: next(compiled))

    def call() -> None:  # an op of two launches
        JITFunction.run(object())  # type: ignore[arg-type]
        JITFunction.run(object())  # type: ignore[arg-type]

    assert pr.stage_resources(pr.OpStage("op", call, 1.0, 1.0)) == (72, 3, 4096)
    assert pr.stage_resources(pr.OpStage("op", lambda: None, 1.0, 1.0)) == (None, None, None)  # interpreter
