"""Isolation: a trial that crashes or hangs its process costs one trial, and the next one runs."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from dtune.tune.search import worker_env
from dtune.tune.trials import TrialJob
from dtune.tune.worker import Worker, must_restart

SHAPE = {"B": 1, "T": 2, "H": 1, "HV": 1, "K": 16, "V": 16}


def job(mode: str) -> TrialJob:
    return TrialJob("fake_recurrent", SHAPE, "fp32", {"MODE": mode, "BV": 8}, 1e-4, device="cpu", warmup=1, repeats=1)


def test_crash_timeout_and_restart(fake: ModuleType, tmp_path: Path) -> None:
    worker = Worker(env=worker_env(interpret=True), log_path=tmp_path / "worker.log")
    try:
        ok = worker.run(job("ok"), timeout=60)
        assert ok.ok, ok.message
        first_pid = worker.proc.pid if worker.proc else None

        crash = worker.run(job("crash"), timeout=60)
        assert crash.reason == "crash" and "exit code 3" in crash.message

        hang = worker.run(job("hang"), timeout=3)
        assert hang.reason == "timeout" and "no result after 3 s" in hang.message

        again = worker.run(job("ok"), timeout=60)
        assert again.ok, again.message
        assert worker.restarts == 2
        assert worker.proc is not None and worker.proc.pid != first_pid
    finally:
        worker.close()
    assert worker.proc is not None and worker.proc.poll() is not None  # no process left behind


def test_gpu_errors_restart_the_worker() -> None:
    """An illegal memory access surfaces as an untyped exception ("crash"): the CUDA context is then poisoned, so the
    worker must start fresh, as after a launch failure ("runtime"); gate failures and CPU errors keep it."""
    assert must_restart("crash", "cuda") and must_restart("runtime", "cuda:1")
    assert not must_restart("gate", "cuda") and not must_restart(None, "cuda")
    assert not must_restart("crash", "cpu")
