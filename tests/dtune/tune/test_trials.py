"""Trial evaluation in-process: typed outcomes instead of exceptions."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton.runtime.errors import OutOfResources

from dtune.measure.resources import resources_of
from dtune.tune.trials import TrialJob, TrialOutcome, classify, evaluate

SHAPE = {"B": 1, "T": 3, "H": 1, "HV": 1, "K": 16, "V": 16}


def job(kernel: str, config: dict[str, object], dtype: str = "fp32") -> TrialJob:
    return TrialJob(kernel, SHAPE, dtype, config, 1e-4, device="cpu", warmup=1, repeats=2)


def test_passing_config_is_timed() -> None:
    out = evaluate(job("fused_recurrent_gated_delta_rule", {"BV": 8}))
    assert out.ok, out.message
    assert out.time_ms is not None and out.time_ms > 0 and out.meaningful is False
    assert out.error_o is not None and out.error_o < 1e-4
    assert out.gbs is not None and out.tflops is not None
    assert out.registers is None  # no compiled kernel under the interpreter


@pytest.mark.parametrize(
    ("mode", "reason", "match"),
    [
        ("compile", "compile", "power of 2"),
        ("wrong", "gate", "relative RMS error"),
        ("unwritten", "gate", "NaN/Inf"),
    ],
)
def test_planted_failures_are_typed(fake: ModuleType, mode: str, reason: str, match: str) -> None:
    out = evaluate(job(fake.NAME, {"MODE": mode, "BV": 8}))
    assert out.reason == reason
    assert match in out.message
    assert out.time_ms is None


def test_illegal_config_never_launches(fake: ModuleType) -> None:
    out = evaluate(job(fake.NAME, {"MODE": "crash", "BV": 3}))  # would kill the process if launched
    assert out.reason == "compile" and "illegal config" in out.message


def test_outcome_round_trips_json() -> None:
    out = TrialOutcome(reason="gate", message="x", error_o=float("inf"))
    assert TrialOutcome.from_dict(out.as_dict()) == out


class _Meta:
    shared = 4096


class _Compiled:
    n_regs, n_spills, metadata = 96, 2, _Meta()


def test_resources_and_classification() -> None:
    assert resources_of([_Compiled(), _Compiled()]) == (96, 4, 4096)
    assert resources_of([None]) == (None, None, None)
    assert classify(OutOfResources(300000, 232448, "shared memory"), first_launch=True) == "resources"
    assert classify(torch.OutOfMemoryError("CUDA out of memory"), first_launch=False) == "resources"
    assert classify(ValueError("bad"), first_launch=True) == "compile"
    assert classify(RuntimeError("illegal memory access"), first_launch=False) == "runtime"


def test_compile_without_launch_forces_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.jit import JITFunction

    from dtune.tune.trials import compile_without_launch

    seen: list[bool] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **k: seen.append(warmup))
    with compile_without_launch():
        JITFunction.run(object(), grid=(1,), warmup=False)  # type: ignore[call-arg]
    JITFunction.run(object(), grid=(1,), warmup=False)  # type: ignore[call-arg]
    assert seen == [True, False]


def test_compile_only_job_reports_compile_errors(fake: ModuleType) -> None:
    ok = evaluate(TrialJob(fake.NAME, SHAPE, "fp32", {"MODE": "ok", "BV": 8}, 1e-4, device="cpu", compile_only=True))
    assert ok.ok and ok.compile_s is not None and ok.time_ms is None
    bad = evaluate(
        TrialJob(fake.NAME, SHAPE, "fp32", {"MODE": "compile", "BV": 8}, 1e-4, device="cpu", compile_only=True)
    )
    assert bad.reason == "compile"


def test_compile_only_also_builds_the_gate_edge_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile pool must build every specialisation the timing worker will launch, the gate's packed
    variable-length edge case included (on the H200 the timing worker otherwise compiled it, ~10 s a trial)."""
    import dtune.ops

    calls: list[bool] = []
    real = dtune.ops.run_kernel

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("cu_seqlens") is not None)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dtune.ops, "run_kernel", spy)
    out = evaluate(TrialJob("fused_recurrent_kda", SHAPE, "fp32", {"BV": 8}, 1e-4, device="cpu", compile_only=True))
    assert out.ok, out.message
    assert calls == [False, True]  # the timed problem, then the varlen edge case
