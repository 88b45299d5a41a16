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


CHUNK_SHAPE = {"B": 1, "T": 5, "H": 1, "HV": 2, "K": 16, "V": 32}
STAGE_MAP = {"intra": ["intra"], "state": ["state", "state+output"], "output": ["output"]}


def chunk_job(config: dict[str, object], shape: dict[str, int] = CHUNK_SHAPE, **kw: object) -> TrialJob:
    args: dict[str, object] = {"device": "cpu", "warmup": 1, "repeats": 2, "stage_launches": STAGE_MAP, **kw}
    return TrialJob("chunk_gated_delta_rule", shape, "fp32", config, 2e-3, **args)  # type: ignore[arg-type]


def test_whole_trial_times_the_call_and_every_stage() -> None:
    out = evaluate(chunk_job({"FUSE_OUTPUT": False, "BT": 16}))
    assert out.ok, out.message
    assert out.time_ms is not None and set(out.stage_ms) == {"intra", "state", "output"}
    assert set(out.stage_resources) == {"intra", "state", "output"}  # [None, None, None] each: the interpreter
    assert out.built == 0  # nothing is compiled under the interpreter


def test_stage_trial_times_only_its_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage-local move is gated on the tuned shape (no edge case) and only its stage is timed."""
    import dtune.tune.trials as trials

    timed: list[str] = []
    real = trials.time_call

    def spy(fn: object, *args: object, **kw: object) -> object:
        timed.append(getattr(fn, "__qualname__", ""))
        return real(fn, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(trials, "time_call", spy)
    out = evaluate(chunk_job({"FUSE_OUTPUT": True, "BT": 16}, kind="stage", stage="state", edge=False))
    assert out.ok, out.message
    assert out.time_ms is None and set(out.stage_ms) == {"state"}
    assert timed == ["_group_call.<locals>.run"]  # the state pass alone, not the whole call
    missing = evaluate(chunk_job({"FUSE_OUTPUT": True, "BT": 16}, kind="stage", stage="output", edge=False))
    assert missing.reason == "runtime" and "no stage 'output'" in missing.message  # fused: no output launch


def test_inputs_and_reference_are_kept_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing a real-size input set costs seconds: a worker draws the timed inputs and the gate's once per shape."""
    import dtune.tune.gate as gate_mod
    import dtune.tune.trials as trials

    drawn: list[str] = []
    real_run, real_ref = trials.op_run, gate_mod.chunk_reference
    monkeypatch.setattr(trials, "op_run", lambda *a, **k: drawn.append("timed") or real_run(*a, **k))
    monkeypatch.setattr(gate_mod, "chunk_reference", lambda *a, **k: drawn.append("ref") or real_ref(*a, **k))
    trials._RUNS.clear()
    gate_mod._CASES.clear()
    for bt in (16, 32):
        assert evaluate(chunk_job({"BT": bt}, reuse_inputs=True, gate_seed=7)).ok
    assert drawn == ["timed", "ref", "ref"]  # once: the tuned shape's reference and the edge case's
    assert evaluate(chunk_job({"BT": 16}, reuse_inputs=False, gate_seed=7)).ok
    assert drawn[3:] == ["timed", "ref", "ref"]  # without reuse: drawn afresh


def test_packed_batch_is_timed_and_gated_as_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """--packed-seqs: the timed call and the gate both run the packed variable-length batch (cu_seqlens)."""
    import dtune.ops

    seen: list[tuple[int, ...] | None] = []
    real = dtune.ops.run_kernel

    def spy(*args: object, **kw: object) -> object:
        cu = kw.get("cu_seqlens")
        seen.append(None if cu is None else tuple(cu.tolist()))  # type: ignore[attr-defined]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(dtune.ops, "run_kernel", spy)
    bucket = {"B": 3, "T": 10, "H": 1, "HV": 2, "K": 16, "V": 32}
    out = evaluate(chunk_job({"BT": 16}, seq_lens=[1, 17, 12], edge=False, shape=bucket))
    assert out.ok, out.message
    assert seen and set(seen) == {(0, 1, 18, 30)}  # every call, gate included, on the packed batch


def test_memory_ceiling_fails_the_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole trial whose call peaks above ``max_memory_mb`` fails with reason ``memory`` (never exported, never
    timed); under the ceiling it passes and records its peak."""
    import dataclasses

    import dtune.tune.trials as trials

    monkeypatch.setattr(trials, "peak_mb", lambda call, device: 900.0)  # the interpreter's CPU has no CUDA peak
    base = job("fused_recurrent_gated_delta_rule", {"BV": 8})
    over = evaluate(dataclasses.replace(base, max_memory_mb=512))
    assert over.reason == "memory" and "900 MiB" in over.message and "512 MiB" in over.message
    assert over.peak_mb == 900.0 and over.time_ms is None
    under = evaluate(dataclasses.replace(base, max_memory_mb=1024))
    assert under.ok, under.message
    assert under.peak_mb == 900.0 and under.time_ms is not None
    assert evaluate(base).peak_mb is None  # no ceiling, no CUDA device: not measured


@pytest.mark.gpu
def test_a_compile_job_on_the_gpu_measures_its_peak_and_frees_it() -> None:
    """Compile-ahead on a GPU: uninitialised inputs, the job's peak reported (what the compile pool admits the next
    job of the shape by), and no memory kept per job: a compile worker that runs job after job does not grow.

    Run as a compile worker runs, without the tests' output guards (tests/conftest.py): their list keeps every output
    a launcher allocated for the out-of-range check, which H100 runs of this test counted as 10.3–10.8 MiB kept per
    job (commits 6be175a, 6aa056d; the outputs and intermediates of B2 T1024 H4 D128) and 44 MiB after the first
    (ffd81b6); without them, 0.00 MiB a job (b6c59d4, outside pytest). The first job
    may keep what a process keeps whatever it runs (Triton's and torch's workspaces), so growth counts from the
    second."""
    import dtune.kernels.config as kernel_config

    guards, kernel_config.GUARDS = kernel_config.GUARDS, None
    try:
        _compile_jobs_keep_nothing()
    finally:
        kernel_config.GUARDS = guards


def _compile_jobs_keep_nothing() -> None:
    dev = torch.device("cuda")
    shape = {"B": 2, "T": 1024, "H": 4, "HV": 4, "K": 128, "V": 128}
    inputs_mb = 3 * 2 * 1024 * 4 * 128 * 2 / 2**20  # q, k, v in bf16
    for kernel in ("chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd"):
        job = TrialJob(kernel, shape, "bf16", {}, 2e-2, device="cuda", compile_only=True, reuse_inputs=True)
        allocated = [torch.cuda.memory_allocated(dev)]
        for _ in range(4):
            out = evaluate(job)
            assert out.ok, out.message
            assert out.peak_mb is not None and out.peak_mb > inputs_mb, (kernel, out.peak_mb)
            allocated.append(torch.cuda.memory_allocated(dev))
        kept_mb = [(b - a) / 2**20 for a, b in zip(allocated, allocated[1:])]
        assert max(kept_mb[1:]) < 1 < inputs_mb, (kernel, kept_mb)  # a job that kept its inputs: 6 MiB a run
