"""The peers dtune bench (and dtune profile's launch modes) time: FlashQLA where it runs, else a one-line reason; fla on
its own Triton path, its Gated DeltaNet backward refusal lifted for timing; neither counted as the other."""

from __future__ import annotations

import sys
import types
from typing import Any

import pandas as pd
import pytest
import torch

from dtune.measure import baselines as bl
from dtune.measure.bench import add_speedups
from dtune.measure.grad import StepResult, with_output_grads
from dtune.measure.inputs import make_inputs
from dtune.report import data as report_data
from dtune.shape import Gate, Shape

GDN = Shape(B=2, T=64, H=2, HV=2, K=128, V=128, gate=Gate.SCALAR)


@pytest.mark.parametrize(
    ("kernel", "shape", "dtype", "cap", "why"),
    [
        ("chunk_gated_delta_rule", GDN, torch.bfloat16, (9, 0), ""),
        ("chunk_gated_delta_rule_bwd", GDN, torch.float16, (10, 0), ""),
        ("chunk_gated_delta_rule", GDN, torch.bfloat16, (12, 0), ""),  # forward only there
        ("chunk_gated_delta_rule", None, None, (9, 0), ""),  # shape and dtype not known: checked at the call
        ("chunk_kda", GDN, torch.bfloat16, (9, 0), "Gated DeltaNet only (chunk_gated_delta_rule), not chunk_kda"),
        ("chunk_delta_rule_bwd", GDN, torch.bfloat16, (9, 0), "not chunk_delta_rule"),
        ("chunk_gated_delta_rule", GDN, torch.bfloat16, None, "needs a CUDA GPU"),
        ("chunk_gated_delta_rule", GDN, torch.bfloat16, (8, 0), "no kernels for sm_80 (only sm_90, sm_100"),
        ("chunk_gated_delta_rule_bwd", GDN, torch.bfloat16, (12, 0), "no backward for sm_120"),
        ("chunk_gated_delta_rule", Shape(1, 64, 2, 2, 64, 64, gate=Gate.SCALAR), torch.bfloat16, (9, 0),
         "needs K = V = 128, got K = 64, V = 64"),
        ("chunk_gated_delta_rule", Shape(1, 64, 2, 2, 128, 64, gate=Gate.SCALAR), torch.bfloat16, (9, 0),
         "got K = 128, V = 64"),
        ("chunk_gated_delta_rule", GDN, torch.float32, (9, 0), "needs bf16 or fp16 inputs, got float32"),
    ],
)  # fmt: skip
def test_flashqla_skip_reasons(
    kernel: str, shape: Shape | None, dtype: torch.dtype | None, cap: tuple[int, int] | None, why: str
) -> None:
    got = bl.flashqla_skip(kernel, shape, dtype, cap)
    if not why:
        assert got == ""
    else:
        assert why in got
        assert got.endswith(": skipped") and "\n" not in got


def test_flashqla_not_importable_is_a_one_line_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_qla", None)  # import raises ImportError
    monkeypatch.setattr(bl, "_capability", lambda: (9, 0))
    impls, notes = bl.build_impls("chunk_gated_delta_rule", ["flashqla"], None, "store", True, GDN, torch.bfloat16)
    assert [i.name for i in impls] == ["tuned"]
    assert len(notes) == 1 and notes[0].startswith("FlashQLA not importable (") and notes[0].endswith(": skipped")
    impls, notes = bl.build_impls("chunk_gated_delta_rule", ["flashqla"], None, "store", on_gpu=False)
    assert [i.name for i in impls] == ["tuned"] and notes == ["FlashQLA needs a CUDA GPU: skipped"]


def fake_flash_qla(calls: list[dict[str, Any]]) -> types.ModuleType:
    """A stand-in for flash_qla: keyword-only like the real call convention, differentiable in every input."""

    def chunk_gated_delta_rule(**kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append(kw)
        o = kw["v"] * kw["beta"][..., None] + kw["g"][..., None] * kw["q"].sum() * kw["k"].mean()
        ht = kw["initial_state"] * 2.0 if kw["output_final_state"] else None
        return o, ht

    module = types.ModuleType("flash_qla")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("backward", [False, True])
def test_flashqla_baseline_calls_it_by_keyword(monkeypatch: pytest.MonkeyPatch, backward: bool) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "flash_qla", fake_flash_qla(calls))
    monkeypatch.setattr(bl, "_capability", lambda: (9, 0))
    kernel = "chunk_gated_delta_rule" + ("_bwd" if backward else "")
    impls, notes = bl.build_impls(kernel, ["flashqla"], None, "store", True, GDN, torch.bfloat16)
    assert notes == [] and [i.name for i in impls] == ["tuned", "flashqla"]
    x = make_inputs(Shape(1, 10, 1, 1, 8, 8, gate=Gate.SCALAR), seq_lens=[4, 6])
    x |= {"scale": 0.5, "output_final_state": True}
    x = with_output_grads(x) if backward else x
    out = impls[1].make(x)()
    kw = calls[-1]
    assert set(kw) == {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens"}
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["scale"] == 0.5  # int64 offsets, as FlashQLA takes them
    if backward:
        assert isinstance(out, StepResult) and out.grads["q"] is not None and out.grads["initial_state"] is not None
    else:
        assert out[0].shape == x["v"].shape


def test_flashqla_cannot_run_kda_or_d64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_qla", fake_flash_qla([]))
    monkeypatch.setattr(bl, "_capability", lambda: (9, 0))
    for kernel, shape in [("chunk_kda", GDN), ("chunk_gated_delta_rule", Shape(1, 8, 1, 1, 64, 64, gate=Gate.SCALAR))]:
        impls, notes = bl.build_impls(kernel, ["flashqla"], None, "store", True, shape, torch.bfloat16)
        assert [i.name for i in impls] == ["tuned"] and len(notes) == 1 and notes[0].endswith(": skipped")


def test_fla_rows_run_fla_s_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fla")
    for name in bl.FLA_TRITON_ONLY:
        monkeypatch.setenv(name, "1")  # restored after the test
    impls, _ = bl.build_impls("chunk_kda", ["fla"], None, "store", True)
    assert [i.name for i in impls] == ["tuned", "fla", "fla_fast"]
    import os

    assert all(os.environ[k] == "0" for k in bl.FLA_TRITON_ONLY)  # FlashQLA, TileLang, FlashKDA, dtune's: off
    assert all(i.note.startswith("fla's Triton path (FLA_FLASH_QLA=0") for i in impls[1:])


def test_fla_gated_backward_refusal_lifted_for_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = True, True, False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    note = bl.lift_fla_triton_check()
    assert "issue 640" in note and "lifted for timing" in note
    assert chunk_o.TRITON_ABOVE_3_7_1 is True  # type: ignore[attr-defined]
    assert bl.lift_fla_triton_check() == ""  # nothing left to lift
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_7_1 = False, False  # type: ignore[attr-defined]
    assert bl.lift_fla_triton_check() == "" and chunk_o.TRITON_ABOVE_3_7_1 is False  # type: ignore[attr-defined]


def test_gated_fla_step_row_carries_the_lift(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fla")
    monkeypatch.setattr(bl, "lift_fla_triton_check", lambda: "lifted (test)")
    for name in bl.FLA_TRITON_ONLY:
        monkeypatch.delenv(name, raising=False)
    step, _ = bl.build_impls("chunk_gated_delta_rule_bwd", ["fla"], None, "store", True)
    fwd, _ = bl.build_impls("chunk_gated_delta_rule", ["fla"], None, "store", True)
    assert step[1].note.endswith("; lifted (test)") and "lifted" not in fwd[1].note


def test_flashqla_is_not_fla_in_speedups_or_the_report() -> None:
    shape = {"kernel": "chunk_gated_delta_rule_bwd", "dtype": "bf16", "mode": "fwd+bwd", "B": 8, "T": 4096}
    shape |= {"H": 16, "HV": 16, "K": 128, "V": 128, "N": 8, "meaningful": True}
    rows = [
        {**shape, "impl": "tuned", "median_ms": 4.0},
        {**shape, "impl": "fla", "median_ms": 3.0},
        {**shape, "impl": "flashqla", "median_ms": 1.2},
    ]
    f = add_speedups(pd.DataFrame(rows)).set_index("impl")
    assert f.loc["tuned", "speedup_vs_fla"] == pytest.approx(0.75)  # against fla's 3.0, not FlashQLA's 1.2
    vs, against = report_data.versus(pd.DataFrame(rows))
    assert against == "fla" and vs is not None
    assert vs["other_ms"].tolist() == [3.0] and vs["other"].tolist() == ["fla default"]
