"""One harness: the search's trials and dtune bench time the same call (inputs, workload, work model)."""

from __future__ import annotations

import pytest
import torch

from dtune.measure import bench as b
from dtune.measure.grids import make_grid
from dtune.measure.harness import op_run
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.work import io_bytes
from dtune.shape import Gate, Shape
from dtune.tune.trials import TrialJob, evaluate

KERNEL = "fused_recurrent_kda"
SHAPE = Shape(B=2, T=3, H=1, HV=2, K=16, V=16)


def test_the_default_workload_reads_and_writes_the_state() -> None:
    run = op_run(KERNEL, SHAPE, torch.float32, "cpu")
    assert run.workload == DEFAULT_WORKLOAD and run.shape.gate is Gate.CHANNEL
    assert run.inputs["initial_state"] is not None and run.inputs["output_final_state"] is True
    assert run.work.bytes == io_bytes(run.shape, torch.float32, initial_state=True, final_state=True)
    o, s = run.call({"BV": 8})()
    assert s is not None and o.shape == (2, 3, 2, 16)
    bare = op_run(KERNEL, SHAPE, torch.float32, "cpu", Workload(initial_state=False, final_state=False))
    assert bare.inputs["initial_state"] is None and bare.call(None)()[1] is None
    packed = op_run(KERNEL, SHAPE, torch.float32, "cpu", Workload(seq_lens=(1, 4, 0)))
    assert (packed.shape.B, packed.shape.T, packed.shape.N, packed.shape.varlen) == (1, 5, 3, True)
    assert packed.inputs["cu_seqlens"].tolist() == [0, 1, 5, 5]


def test_trials_and_bench_measure_the_same_work() -> None:
    job = TrialJob(KERNEL, SHAPE.bucket(), "fp32", {"BV": 8}, 1e-4, device="cpu", warmup=1, repeats=2)
    assert job.workload() == DEFAULT_WORKLOAD
    out = evaluate(job)
    assert out.ok and out.time_ms and out.gbs and out.tflops
    grid = make_grid(KERNEL, on_gpu=False, seq_lens=[SHAPE.T], head_dims=[16], heads=[1], batches=[2])
    res = b.run_bench(KERNEL, grid, torch.float32, ["default"], device="cpu")
    row = res.frame.iloc[0]
    assert (row["B"], row["T"]) == (2, 3)
    # GB/s and TFLOP/s are one work model over the time, in the trial as in the benchmark (for H = HV = 1 here)
    bench_shape = Shape(B=2, T=3, H=1, HV=1, K=16, V=16, gate=Gate.CHANNEL)
    assert row["bytes"] == op_run(KERNEL, bench_shape, torch.float32, "cpu").work.bytes
    trial_bytes = out.gbs * out.time_ms * 1e-3 * 1e9
    assert trial_bytes == pytest.approx(op_run(KERNEL, SHAPE, torch.float32, "cpu").work.bytes)
