"""dtune.tune.memory: compile jobs admitted against a GPU memory budget, weighed by their shape's measured peak."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from dtune.measure.grad import output_grads
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from dtune.tune.memory import CompileMemory, estimate_bytes, shape_key
from dtune.tune.trials import TrialJob, TrialOutcome

GB = 2**30


def job(T: int = 4096, K: int = 128, kernel: str = "chunk_kda") -> TrialJob:
    shape = {"B": 8, "T": T, "H": 16, "HV": 16, "K": K, "V": K}
    return TrialJob(kernel, shape, "bf16", {"BT": 32}, 1e-2, device="cuda", compile_only=True)


def test_no_budget_admits_everything_at_no_weight() -> None:
    mem = CompileMemory(None)
    assert mem.weight(job()) == 0
    assert all(mem.acquire(mem.weight(job())) for _ in range(20))


def test_jobs_wait_for_room_and_one_is_always_admitted() -> None:
    mem = CompileMemory(10 * GB, estimate=lambda j: 4 * GB)
    w = mem.weight(job())
    assert w == 4 * GB
    assert mem.acquire(w) and mem.acquire(w)  # 8 of 10 GB
    admitted = threading.Event()

    def third() -> None:
        mem.acquire(w)
        admitted.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    time.sleep(0.3)
    assert not admitted.is_set()  # 12 GB would not fit
    mem.release(w)
    assert admitted.wait(5)
    t.join(5)
    assert mem.in_use == 8 * GB
    mem.release(w)
    mem.release(w)
    huge = CompileMemory(1 * GB, estimate=lambda j: 50 * GB)
    assert huge.acquire(huge.weight(job()))  # alone, however heavy: a job is never refused for its size


def test_a_job_no_longer_wanted_stops_waiting_and_holds_nothing() -> None:
    mem = CompileMemory(4 * GB, estimate=lambda j: 3 * GB)
    assert mem.acquire(3 * GB)
    assert mem.acquire(3 * GB, wanted=lambda: False) is False
    assert mem.in_use == 3 * GB


def test_a_measured_peak_replaces_the_estimate_for_that_shape_only() -> None:
    mem = CompileMemory(40 * GB, estimate=lambda j: 12 * GB)
    a, b = job(), job(T=1024)
    w = mem.weight(a)
    mem.acquire(w)
    mem.release(w, replace(a, config={"BT": 64}), TrialOutcome(peak_mb=4096.0))  # 4 GiB, another config
    assert mem.weight(a) == int(1.1 * 4 * GB)
    assert mem.weight(b) == 12 * GB
    mem.acquire(0)
    mem.release(0, a, TrialOutcome(peak_mb=1024.0))  # a smaller peak never lowers the shape's weight
    assert mem.weight(a) == int(1.1 * 4 * GB)
    mem.release(0, b, TrialOutcome(reason="compile"))  # no peak measured: nothing learned
    assert mem.weight(b) == 12 * GB
    assert shape_key(a) == shape_key(replace(a, config={"BT": 16})) != shape_key(b)


def test_the_estimate_grows_with_the_shape_and_tolerates_unknown_kernels() -> None:
    small, big = estimate_bytes(job(T=1024)), estimate_bytes(job(T=4096, K=256))
    assert 0 < small < big
    assert big > 4 * GB  # K = V = 256 at 32768 tokens: about what each of the compiles that filled an H100 held
    assert estimate_bytes(job(kernel="no_such_kernel")) == 0


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
@pytest.mark.parametrize("packed", [False, True])
def test_blank_inputs_have_the_drawn_inputs_shapes_and_dtypes(gate: Gate, packed: bool) -> None:
    p = Shape(2, 24, 2, 4, 16, 8, 2, gate)
    lens = [5, 19] if packed else None
    for h0 in (True, False):
        drawn = make_inputs(p, torch.bfloat16, seed=1, seq_lens=lens, initial_state=h0)
        blank = make_inputs(p, torch.bfloat16, seed=1, seq_lens=lens, initial_state=h0, values=False)
        assert drawn.keys() == blank.keys()
        for name, x in drawn.items():
            y = blank[name]
            if name == "cu_seqlens":
                assert (x is None and y is None) or torch.equal(x, y)
            elif x is None:
                assert y is None, name
            else:
                assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device), name
        x = {**drawn, "output_final_state": True}
        do, dht = output_grads(x)
        bdo, bdht = output_grads(x, values=False)
        assert (bdo.shape, bdo.dtype) == (do.shape, do.dtype)
        assert dht is not None and bdht is not None and (bdht.shape, bdht.dtype) == (dht.shape, dht.dtype)
