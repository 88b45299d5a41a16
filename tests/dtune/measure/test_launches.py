"""dtune profile --mode fwd / fwd+bwd: launches from profiler events, launches matched to stages, the table, the CLI."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import typer
from typer.testing import CliRunner

from dtune.cli.measure import register
from dtune.measure import launches as la
from dtune.measure import work as wm
from dtune.measure.harness import op_run
from dtune.shape import Gate, Shape

ROOFS = wm.Roofs(gbs=4000.0, tflops=800.0, source="test")
CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name: str, start_us: float, dur_us: float, device: Any = CUDA) -> types.SimpleNamespace:
    """What torch.profiler's events() holds for one launch: name, device type, time range in µs."""
    return types.SimpleNamespace(
        name=name, device_type=device, time_range=types.SimpleNamespace(start=start_us, end=start_us + dur_us)
    )


def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


# ---- launches from the profiler -----------------------------------------------------------------------------------


def test_device_launches_in_the_order_they_ran_without_host_events() -> None:
    events = [
        event("chunk_state_kernel", 300.0, 200.0),
        event("aten::empty", 0.0, 5.0, CPU),  # host-side: not a launch
        event("cudaLaunchKernel", 10.0, 3.0, CPU),
        event("chunk_intra_blocks_kernel", 20.0, 250.0),
        event("Memset (Device)", 290.0, 2.0),
        event("autograd::engine::evaluate_function: ChunkFunctionBackward", 280.0, 230.0),  # holds two: no launch
    ]
    assert la.device_launches(events) == [
        ("chunk_intra_blocks_kernel", 0.25),
        ("Memset (Device)", 0.002),
        ("chunk_state_kernel", 0.2),
    ]


def test_per_call_means_over_identical_calls_and_groups_otherwise() -> None:
    two_calls = [("a", 1.0), ("b", 2.0), ("a", 3.0), ("a", 5.0), ("b", 4.0), ("a", 7.0)]
    launches, note = la.per_call(two_calls, 2)
    assert note == ""
    assert launches == [la.Launch("a", 3.0), la.Launch("b", 3.0), la.Launch("a", 5.0)]
    # the second call launched something else: by name, per call
    odd = [("a", 1.0), ("b", 2.0), ("a", 3.0), ("c", 4.0)]
    launches, note = la.per_call(odd, 2)
    assert "different kernel sequences" in note
    assert launches == [la.Launch("a", 2.0, 1.0), la.Launch("b", 1.0, 0.5), la.Launch("c", 2.0, 0.5)]
    launches, note = la.per_call(two_calls[:5], 2)  # not a whole number of calls
    assert note and sum(x.ms for x in launches) == pytest.approx(7.5)


# ---- kernel names to stages ---------------------------------------------------------------------------------------


def sw(name: str, kernel: str, nbytes: float = 1e9, flops: float = 0.0) -> wm.StageWork:
    return wm.StageWork(name, kernel, wm.Work(flops, nbytes))


# KDA's training step with SAVE = "none" and a segmented forward: the plan's stages (intra launches the one-pass
# kernel, then the blocks kernel's exact redo), then the backward's (the intra re-run launches the blocks kernel
# twice: DIAG 1, then the redo).
KDA_STAGES = [
    sw("fwd intra", "chunk_intra_onepass_kernel"),
    sw("fwd intra", "chunk_intra_blocks_kernel", 0.0),
    sw("fwd transitions", "chunk_state_kernel"),
    sw("fwd segment-starts", "chunk_segment_starts_regs_kernel"),
    sw("fwd state+output", "chunk_state_kernel"),
    sw("bwd intra re-run", "chunk_intra_blocks_kernel"),
    sw("bwd state re-run (S, V_new)", "chunk_state_kernel"),
    sw("bwd reverse state pass", "chunk_bwd_state_kernel"),
    sw("bwd dq/dk/dv (fused)", "chunk_bwd_dqk_kernel"),
    sw("bwd finish (dβ)", "chunk_bwd_finish_kernel"),
]
KDA_LAUNCHES = [
    "chunk_intra_onepass_kernel",
    "chunk_intra_blocks_kernel",
    "chunk_state_kernel",
    "chunk_segment_starts_regs_kernel",
    "chunk_state_kernel",
    "chunk_intra_blocks_kernel",
    "chunk_intra_blocks_kernel",  # the re-run's exact redo: no stage of its own
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",  # PyTorch's
    "chunk_state_kernel",
    "chunk_bwd_state_kernel",
    "chunk_bwd_dqk_kernel",
    "chunk_bwd_finish_kernel",
]


def test_match_stages_by_kernel_name_in_order() -> None:
    launches = [la.Launch(name, 0.1) for name in KDA_LAUNCHES]
    owner, missing = la.match_stages(launches, KDA_STAGES)
    assert owner == [
        "fwd intra",
        "fwd intra",
        "fwd transitions",
        "fwd segment-starts",
        "fwd state+output",
        "bwd intra re-run",
        "bwd intra re-run",
        None,
        "bwd state re-run (S, V_new)",
        "bwd reverse state pass",
        "bwd dq/dk/dv (fused)",
        "bwd finish (dβ)",
    ]
    assert missing == []
    # a modelled stage that did not launch is reported, and the rest still match
    owner, missing = la.match_stages(launches[:2] + launches[5:], KDA_STAGES)
    assert [s.name for s in missing] == ["fwd transitions", "fwd segment-starts", "fwd state+output"]
    assert owner[2:4] == ["bwd intra re-run", "bwd intra re-run"]
    assert owner[-4:] == ["bwd state re-run (S, V_new)", "bwd reverse state pass", "bwd dq/dk/dv (fused)",
                          "bwd finish (dβ)"]  # fmt: skip
    # the state pass in Gluon (STATE_LOOP = "gluon") is the state pass's stage
    gluon = [la.Launch("chunk_state_ws_kernel" if n == "chunk_state_kernel" else n, 0.1) for n in KDA_LAUNCHES]
    assert la.match_stages(gluon, KDA_STAGES)[0] == la.match_stages(launches, KDA_STAGES)[0]
    # ... and the reverse pass in Gluon (dh_LOOP = "gluon") the reverse pass's
    rev = {"chunk_bwd_state_kernel": "chunk_bwd_state_ws_kernel", "chunk_bwd_dqk_kernel": "chunk_bwd_dqk_ws_kernel"}
    gluon = [la.Launch(rev.get(n, n), 0.1) for n in KDA_LAUNCHES]
    assert la.match_stages(gluon, KDA_STAGES)[0] == la.match_stages(launches, KDA_STAGES)[0]


def test_launch_rows_floor_per_stage_and_the_whole_call() -> None:
    stages = [sw("intra", "k_intra", 4e9, 8e12), sw("intra", "k_redo", 0.0), sw("state", "k_state", 2e9)]
    launches = [la.Launch("k_intra", 3.0), la.Launch("k_redo", 1.0), la.Launch("fill", 0.5), la.Launch("k_state", 1.5)]
    op_work = wm.Work(1e12, 1e9)
    rows, notes = la.launch_rows(launches, stages, ROOFS, op_work, call_ms=6.5)
    assert notes == []
    f = pd.DataFrame(rows)
    assert f["launch"].tolist() == ["k_intra", "k_redo", "fill", "k_state", la.CALL]
    assert f["stage"].tolist() == ["intra", "intra", "", "state", ""]
    intra = f.iloc[0]
    # the stage's time (both its launches) against its floor: max(4 GB at 4 TB/s, 8 TFLOP at 800 TFLOP/s) = 10 ms
    assert intra["stage_ms"] == 4.0 and intra["floor_ms"] == pytest.approx(10.0) and intra["bound"] == "compute"
    assert intra["x_floor"] == pytest.approx(0.4)
    assert math.isnan(f.iloc[1]["floor_ms"]) and math.isnan(f.iloc[2]["floor_ms"])  # shown once, on the first
    assert f.iloc[3]["floor_ms"] == pytest.approx(0.5) and f.iloc[3]["x_floor"] == pytest.approx(3.0)
    assert f["share"].iloc[:4].sum() == pytest.approx(1.0)
    whole = f.iloc[-1]
    assert (whole["position"], whole["count"], whole["ms"]) == (0, 4.0, 6.5)
    assert whole["floor_ms"] == pytest.approx(1.25) and whole["x_floor"] == pytest.approx(5.2)
    assert (f["launches_ms"] == 6.0).all() and (f["call_ms"] == 6.5).all()
    # a stage the call did not launch is named
    _, notes = la.launch_rows(launches[:3], stages, ROOFS, op_work, 5.0)
    assert notes == ["modelled stage 'state' (k_state) was not launched"]


def test_a_peer_s_launches_are_grouped_by_name_without_floors() -> None:
    launches = [la.Launch("fwd_h", 0.4), la.Launch("kkt", 0.2), la.Launch("fwd_h", 0.5)]
    rows, _ = la.launch_rows(launches, None, ROOFS, wm.Work(0.0, 4e9), call_ms=1.2)
    f = pd.DataFrame(rows)
    assert f["launch"].tolist() == ["fwd_h", "kkt", la.CALL]
    assert f["count"].tolist() == [2.0, 1.0, 3.0]
    assert f["ms"].iloc[0] == pytest.approx(0.9)
    assert f["stage"].tolist() == ["", "", ""] and f["floor_ms"].iloc[:2].isna().all()
    assert f["floor_ms"].iloc[-1] == pytest.approx(1.0)  # the whole op's floor: the same for every contestant


def test_printed_tables() -> None:
    rows, _ = la.launch_rows([la.Launch("k_intra", 3.0)], [sw("intra", "k_intra")], ROOFS, wm.Work(0, 1e9), 3.2)
    peer, _ = la.launch_rows([la.Launch("small", 0.1), la.Launch("big", 2.0)], None, ROOFS, wm.Work(0, 1e9), 2.2)
    ident = {"kernel": "chunk_kda", "B": 8, "T": 4096, "H": 16, "K": 128, "V": 128, "mode": "fwd+bwd"}
    frame = pd.concat(
        [pd.DataFrame(rows).assign(impl="tuned", **ident), pd.DataFrame(peer).assign(impl="fla", **ident)]
    ).assign(meaningful=True)
    (t1, headers, r1), (t2, _, r2) = la.tables(frame)
    assert t1.startswith("tuned chunk_kda B8 T4096 H16 D128 fwd+bwd: call 3.200 ms, launches 3.000 ms")
    assert "the op's floor 0.250 ms (memory-bound)" in t1
    assert headers[:2] == ["#", "launch"] and r1[0][:2] == ["1", "k_intra"] and r1[0][5] == "intra"
    assert r1[-1][1] == la.CALL and r1[-1][-1] == "12.8×"
    assert [r[1] for r in r2] == ["big", "small", la.CALL]  # a peer's kernels by time


# ---- the real step: every launch has its stage --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "bwd", "fwd"),
    [
        ("chunk_delta_rule", {}, {}),
        ("chunk_gated_delta_rule", {"SAVE": "all"}, {"FUSE_OUTPUT": False}),
        ("chunk_kda", {"SAVE": "none"}, {"SEG_CHUNKS": 1, "INTRA": "onepass"}),
        ("chunk_kda", {}, {}),
    ],
)
def test_every_launch_of_the_step_has_its_stage(kernel: str, bwd: dict[str, Any], fwd: dict[str, Any]) -> None:
    """Under the interpreter, the Triton launches of dtune's training step, recorded as they run, against the stages
    the work models give: each launch belongs to a stage, each modelled stage with bytes launched."""
    from dtune.kernels import get_kernel

    from dtune.measure.grad import op_step

    gate = Gate(get_kernel(kernel).gate)
    p = Shape(B=1, T=40, H=1, HV=2, K=16, V=16, gate=gate)  # grouped value heads: the group sum after the step
    run = op_run(kernel + "_bwd", p, torch.float32, "cpu")
    fwd_cfg = get_kernel(kernel).check_config(16, 16, fwd)
    bwd_cfg = get_kernel(kernel + "_bwd").check_config(16, 16, bwd)
    step = op_step(kernel, run.inputs, bwd_cfg, fwd_cfg)
    with la.triton_launches() as seen:
        step()
    launches = [la.Launch(name, 1.0) for name, _ in seen]
    stages = la.dtune_stages(run, "fwd+bwd", fwd_cfg, bwd_cfg)
    owner, missing = la.match_stages(launches, stages)
    assert None not in owner, list(zip([x.name for x in launches], owner))
    assert [s.name for s in missing if s.work.bytes > 0] == []
    assert owner[-2:] == ["bwd finish (dβ)", "bwd group sum (dq, dk)"]
    if bwd.get("SAVE") == "none":  # the forward under autograd is the plain one, segmented: the plan's stages
        assert "fwd transitions" in owner and "fwd segment-starts" in owner


def test_forward_stages_come_from_the_plan_with_their_kernels() -> None:
    from dtune.kernels import get_kernel

    p = Shape(B=1, T=40, H=1, HV=1, K=16, V=16, gate=Gate.CHANNEL)
    run = op_run("chunk_kda", p, torch.float32, "cpu")
    cfg = get_kernel("chunk_kda").check_config(16, 16, {"INTRA": "onepass", "SEG_CHUNKS": 1})
    stages = la.dtune_stages(run, "fwd", cfg, None)
    assert [(s.name, s.kernel) for s in stages] == [
        ("intra", "chunk_intra_onepass_kernel"),
        ("intra", "chunk_intra_blocks_kernel"),  # SAFE_DIAG's exact redo: part of the stage, no work of its own
        ("transitions", "chunk_state_kernel"),
        ("segment-starts", "chunk_segment_starts_regs_kernel"),
        ("state+output", "chunk_state_kernel"),
    ]
    assert stages[0].work.bytes > 0 and stages[1].work == wm.Work(0.0, 0.0)


# ---- end to end ---------------------------------------------------------------------------------------------------


def test_profile_launches_cli_end_to_end_under_interpreter(tmp_path: Path) -> None:
    args = ["profile", "-k", "chunk_gated_delta_rule", "--mode", "fwd,fwd+bwd", "--seq-len", "20", "--head-dim",
            "16", "--heads", "1", "--hv-ratio", "2", "--batch", "1", "--interpret", "--calls", "1", "--gpu", "h200",
            "--out", str(tmp_path), "--json"]  # fmt: skip
    r = CliRunner().invoke(cli(), args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{") :])
    f = pd.read_csv(tmp_path / "launches.csv")
    assert list(f.columns) == la.COLUMNS and len(f) == len(out["rows"])
    assert set(f["mode"]) == {"fwd", "fwd+bwd"} and set(f["impl"]) == {"tuned"}
    assert (f["kernel"] == "chunk_gated_delta_rule").all() and not f["meaningful"].any()
    step = f[f["mode"] == "fwd+bwd"]
    assert (f["H"] == 1).all() and (f["HV"] == 2).all()  # --hv-ratio: grouped value heads
    assert step["launch"].tolist()[-2:] == ["chunk_bwd_group_sum_kernel", la.CALL]
    assert step["stage"].fillna("").ne("").sum() == len(step) - 1  # every launch has its stage
    assert step["floor_ms"].notna().sum() == len(step)  # roofs of --gpu: every stage once, and the whole call
    assert json.loads(step["config"].iloc[0]).keys() == {"fwd", "bwd"}
    notes = " ".join(out["notes"])
    assert "needs a CUDA GPU" in notes and "NOT meaningful" in notes  # fla and FlashQLA skipped, with the reason


def test_profile_cli_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    base = ["profile", "--interpret", "--out", str(tmp_path)]
    r = CliRunner().invoke(cli(), [*base, "-k", "chunk_kda", "--seq-len", "32,64"])
    assert r.exit_code == 2 and "--mode stages profiles one shape" in r.output
    r = CliRunner().invoke(cli(), [*base, "-k", "chunk_kda", "--mode", "bwd"])
    assert r.exit_code == 2 and "is not one of stages, fwd, fwd+bwd" in r.output
    r = CliRunner().invoke(cli(), [*base, "-k", "fused_recurrent_kda", "--mode", "fwd+bwd"])
    assert r.exit_code == 2 and "has no backward" in r.output


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["chunk_delta_rule", "chunk_kda"])
def test_cuda_profiler_launches_match_the_stages(kernel: str) -> None:
    """On a GPU, the CUDA profiler's kernel names are the Triton kernels' (every launch of dtune's step has its
    stage, none left over), and the launches add up to about the whole call."""
    from dtune.kernels import get_kernel

    p = Shape(B=2, T=1024, H=4, HV=4, K=64, V=64, gate=Gate(get_kernel(kernel).gate))
    res = la.profile_launches(kernel, p, torch.bfloat16, la.MODES, baselines=(), calls=3)
    f = res.frame
    assert set(f["impl"]) == {"tuned"} and f["meaningful"].all()
    assert not any("was not launched" in n for n in res.notes), res.notes
    for mode, grp in f.groupby("mode"):
        body = grp[grp["launch"] != la.CALL]
        triton = body[body["launch"].str.startswith("chunk_")]  # (the tests' NaN-poisoning adds PyTorch fills)
        assert len(triton) >= 2 and (triton["stage"].fillna("") != "").all(), body[["launch", "stage"]]
        whole = grp[grp["launch"] == la.CALL].iloc[0]
        assert 0.5 < whole["launches_ms"] / whole["call_ms"] < 1.5, (mode, whole["launches_ms"], whole["call_ms"])
        assert body["floor_ms"].notna().any() and (body["ms"] > 0).all()
