"""Isolation: a trial that crashes or hangs its process costs one trial, and the next one runs."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from dtune.tune import executor
from dtune.tune.search import worker_env
from dtune.tune.trials import TrialJob
from dtune.tune.worker import CompilePool, Worker, must_restart

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


def test_an_aborted_search_lets_its_compiles_finish_then_kills_the_rest(
    fake: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a bucket's end (Evaluator.abort) a compile in flight runs on for the grace (what it builds stays in Triton's
    cache, its worker needs no restart), a compile still running after it is killed, a job queued behind it is not
    compiled at all, and a job of the next bucket gets the worker."""
    monkeypatch.setattr(executor, "COMPILE_GRACE_S", 2.0)
    ev = executor.Evaluator(worker_env(interpret=True), tmp_path, trial_timeout=60, compile_workers=1)
    assert ev.pool is not None
    try:
        warm = ev.submit(job("ok")).result(timeout=120)  # the compile worker is up
        assert warm.outcome.ok, warm.outcome.message
        (worker,) = ev.pool._all
        pid = worker.proc.pid if worker.proc else None
        hung = ev.submit(job("hang"))  # compiles forever
        queued = ev.submit(job("ok"))  # waits for the one compile worker
        t0 = time.monotonic()
        while not ev.pool._busy and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        ev.abort()
        time.sleep(1.0)
        assert worker.proc is not None and worker.proc.poll() is None and worker.proc.pid == pid  # within the grace
        assert not hung.done()
        a = hung.result(timeout=20).outcome
        b = queued.result(timeout=20).outcome
        assert time.monotonic() - t0 >= 2.0  # killed once the grace was over, not before
        assert a.reason == "cancelled" and b.reason == "cancelled"
        nxt = ev.submit(job("ok")).result(timeout=120).outcome
        assert nxt.ok, nxt.message  # the next bucket's job: a fresh worker (the hung one was killed)
        assert worker.restarts == 1
    finally:
        ev.close()


def test_the_compile_pool_skips_jobs_it_is_told_to_and_kills_by_tag(fake: ModuleType, tmp_path: Path) -> None:
    pool = CompilePool(1, worker_env(interpret=True), tmp_path, timeout=60)
    stop = [False]
    try:
        hung = pool.submit(replace(job("hang"), compile_only=True), tag=1)
        skipped = pool.submit(replace(job("ok"), compile_only=True), tag=1, skip=lambda: stop[0])
        t0 = time.monotonic()
        while not pool._busy and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        pool.kill_busy(2)  # another tag: nothing happens
        time.sleep(0.5)
        assert not hung.done()
        stop[0] = True
        pool.kill_busy(1)
        assert hung.result(timeout=20).reason == "crash"
        got = skipped.result(timeout=20)
        assert got.reason == "cancelled" and "not compiled" in got.message
    finally:
        pool.close()


def test_an_aborted_search_lets_the_trial_being_timed_finish_and_keeps_its_worker(
    fake: ModuleType, tmp_path: Path
) -> None:
    """A trial that ends within TIMING_GRACE_S of abort is discarded, not killed: the timing worker (a CUDA context
    on a GPU) needs no restart for the next bucket's trials."""
    ev = executor.Evaluator(worker_env(interpret=True), tmp_path, trial_timeout=60)
    try:
        assert ev.submit(job("ok")).result(timeout=120).outcome.ok  # the worker is up
        (timer,) = ev.timers
        fut = ev.submit(job("ok"))
        t0 = time.monotonic()
        while not ev._busy and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        ev.abort()
        assert fut.result(timeout=20).outcome.reason == "cancelled"  # the search closed it already
        assert ev.submit(job("ok")).result(timeout=60).outcome.ok
        assert timer.restarts == 0
    finally:
        ev.close()
