"""benchmarks/host_cost.py: every measured row is in host_cost.csv as soon as it is measured, so that a run cut short
(a time limit, a kill) keeps what it measured."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_cost.py"
sys.path.insert(0, str(SCRIPT.parent))
import host_cost as hc  # noqa: E402


def test_a_run_cut_short_keeps_its_measured_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []

    def measure(call: Any, calls: int, repeats: int, clock: Any) -> dict[str, Any]:
        if len(timed) == 2:
            raise KeyboardInterrupt  # the time limit, during the third measurement
        timed.append(calls)
        return {"host_us": 10.0 + len(timed), "isolated_us": 1.0, "loop_us": 2.0, "calls": calls, "waits": False}

    monkeypatch.setattr(hc, "measure", measure)
    # nothing launched: the rows are the subject
    monkeypatch.setattr(hc, "dtune_call", lambda op, x, opts=None: lambda: None)
    with pytest.raises(KeyboardInterrupt):
        hc.main(["--interpret", "--no-fla", "--ops", "fused_recurrent_delta_rule", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "host_cost.csv").read_text().splitlines()))
    got = [(r["case"], r["impl"], float(r["host_us"])) for r in rows]
    assert got == [("prefill", "dtune", 11.0), ("prefill", "dtune-cached", 12.0)]
    assert not list(tmp_path.glob("*.tmp"))


RECURRENT = ["fused_recurrent_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_delta_rule"]


@pytest.mark.parametrize("op", RECURRENT)
def test_layer_options_time_the_same_call_in_the_kernel_and_as_passes(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--layer-options``: dtune's call, ``dtune-kernels`` (options inside the kernel) and ``dtune-passes`` compute
    the same thing."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = hc.build_inputs(op, hc.Case("decode-B4", 4, 3), interpret=True)
    opts = hc.layer_options(x)
    assert opts["use_qk_l2norm_in_kernel"] and ("A_log" in opts) == (x["g"] is not None)
    calls = (hc.dtune_call(op, x, opts), hc.dtune_kernels_call(op, x, opts), hc.dtune_passes_call(op, x, opts))
    default, fused, passes = (call() for call in calls)
    for a, b, c in zip(default, fused, passes, strict=True):
        assert (a - c).abs().max() <= 1e-5 * c.abs().max() and (b - c).abs().max() <= 1e-5 * c.abs().max()


def test_the_kernels_contestant_lifts_the_length_limits(
    no_option_passes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dtune-kernels`` applies the options inside the kernel above the default call's length limits (no separate
    pass runs here) and leaves the limits as they were."""
    import dtune.options as options_module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(options_module, "IN_KERNEL_MAX_SEQ_LEN", 1)
    x = hc.build_inputs("fused_recurrent_kda", hc.Case("decode-B4", 4, 3), interpret=True)
    hc.dtune_kernels_call("fused_recurrent_kda", x, hc.layer_options(x))()
    assert options_module.IN_KERNEL_MAX_SEQ_LEN == 1


def test_training_times_the_chunk_ops_step(tmp_path: Path) -> None:
    """``--training``: the chunk ops' forward and gradients (rows marked fwd+bwd), the fused-recurrent ops and decode
    cases left out; the step it times returns every input's gradient."""
    hc.main(["--interpret", "--no-fla", "--training", "--ops", "chunk_kda,fused_recurrent_kda", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "host_cost.csv").read_text().splitlines()))
    assert rows and {r["op"] for r in rows} == {"chunk_kda"} and {r["mode"] for r in rows} == {"fwd+bwd"}
    assert all(float(r["T"]) > 1 for r in rows)
    x = hc.with_grads(hc.build_inputs("chunk_kda", hc.CPU_CASES[0], True))
    grads = hc.training_step(hc.dtune_call("chunk_kda", x), x)()
    assert len(grads) == len([n for n in hc.GRAD_INPUTS if x[n] is not None]) == 6
    assert all(g is not None and bool(g.isfinite().all()) for g in grads)
