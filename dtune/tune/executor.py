"""Where trials run: a compile pool ahead of one timing worker per GPU, all fed from one search.

``dtune search --devices 0,1 --compile-ahead 12``: twelve compile workers build upcoming trials' kernels (Triton's
on-disk cache carries the binaries over: every worker inherits the same environment, so the same cache
directory), and two timing workers, one per GPU (``CUDA_VISIBLE_DEVICES`` set per worker), gate and time them
as they come. A trial's compile job and its timing job run in the worker processes of
:mod:`dtune.tune.worker`; here threads only wait on them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from dtune.tune import sanitize
from dtune.tune.memory import CompileMemory, gpu_budget
from dtune.tune.trials import TrialJob, TrialOutcome
from dtune.tune.worker import CompilePool, Worker, WorkerError


@dataclass
class Evaluated:
    """A trial's outcome, with what the compile pool did for it and the device that timed it."""

    outcome: TrialOutcome
    built_ahead: int | None = None  # kernels the compile pool built for this trial (None: no pool, or unknown)
    device: str | None = None


# How long abort lets the compiles in flight run on before it kills them (a chunk kernel's compile is 10-25 s on the
# H200; killing one throws its work away and its worker's restart costs 5-10 s).
COMPILE_GRACE_S = 15.0
# ... and the trial being timed (a gate and its timing take 1-3 s; the next trial waits for the worker either way).
TIMING_GRACE_S = 5.0
# The outcome of a job that abort or close overtook (the caller has closed its trial already).
CANCELLED = TrialOutcome(reason="cancelled", message="the search stopped before this trial finished")


def device_env(env: dict[str, str], device: str | None) -> dict[str, str]:
    """``env`` for a worker pinned to ``device`` (a CUDA device index; None: as it is)."""
    if device is None:
        return dict(env)
    return {**env, "CUDA_VISIBLE_DEVICES": device}


class Evaluator:
    """Runs trial jobs: compile ahead (``compile_workers`` processes, optional), then gate and time on whichever
    timing worker (one per entry of ``devices``) is free. ``capacity`` is how many trials should be in flight to
    keep every worker busy."""

    def __init__(
        self,
        env: dict[str, str],
        log_dir: Path,
        trial_timeout: float,
        compile_workers: int = 0,
        devices: list[str | None] | None = None,
        pin: bool = True,
        sanitizer: str | None = None,
    ) -> None:
        """``devices``: one timing worker each (a label; with ``pin`` also its ``CUDA_VISIBLE_DEVICES``).
        ``sanitizer``: compute-sanitizer's path: a trial that crashes (or fails at run time) is run once more
        under it, and its first error is added to the trial's message (:mod:`dtune.tune.sanitize`)."""
        self.trial_timeout = trial_timeout
        self.sanitizer = sanitizer
        devices = devices or [None]
        self.devices = devices
        self.pool = None
        if compile_workers > 0:
            # under the interpreter the compile workers hold CPU tensors: no GPU to share
            memory = CompileMemory(None if env.get("TRITON_INTERPRET") else gpu_budget())
            self.pool = CompilePool(compile_workers, env, log_dir, trial_timeout, memory)
        self._envs = [device_env(env, d if pin else None) for d in devices]
        self.timers = [
            Worker(
                env=self._envs[i],
                log_path=log_dir / ("worker.log" if i == 0 else f"worker-{i}.log"),
            )
            for i, d in enumerate(devices)
        ]
        self._idle: queue.Queue[int] = queue.Queue()
        for i in range(len(self.timers)):
            self._idle.put(i)
        self._busy: dict[int, int] = {}  # timing worker index -> the generation of the job it runs
        self._lock = threading.Lock()
        self._generation = 0  # bumped by abort/close: a job started before it is over, whatever its worker says
        self._grace: list[threading.Timer] = []  # abort's deferred kills of the compiles it let run on
        self._threads = ThreadPoolExecutor(max_workers=self.capacity + 1, thread_name_prefix="dtune-trial")

    @property
    def capacity(self) -> int:
        return (self.pool.size if self.pool is not None else 0) + len(self.timers)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.timers)

    def submit(self, job: TrialJob) -> Future[Evaluated]:
        return self._threads.submit(self._evaluate, job)

    def _evaluate(self, job: TrialJob) -> Evaluated:
        gen = self._generation

        def stopped() -> bool:
            return self._generation != gen

        built_ahead = None
        if self.pool is not None:
            ahead = self.pool.submit(replace(job, compile_only=True), tag=gen, skip=stopped).result()
            if stopped():
                return Evaluated(CANCELLED)
            if not ahead.ok:  # its peak is the compile's, not the call's
                return Evaluated(replace(ahead, peak_mb=None))
            built_ahead = ahead.built
        index = self._idle.get()
        with self._lock:
            self._busy[index] = gen
        try:
            if stopped():
                return Evaluated(CANCELLED, built_ahead)
            outcome = self.timers[index].run(job, self.trial_timeout)
        except WorkerError as e:
            outcome = TrialOutcome(reason="crash", message=str(e))
        finally:
            with self._lock:
                self._busy.pop(index, None)
            self._idle.put(index)
        if stopped():  # its worker was killed by abort/close: no crash of the trial, and no sanitizer run
            return Evaluated(CANCELLED, built_ahead, self.devices[index])
        if self.sanitizer and outcome.reason in sanitize.REASONS:
            limit = min(180.0, 2 * self.trial_timeout)
            found = sanitize.sanitize_job(job, self._envs[index], self.sanitizer, limit, cancelled=stopped)
            outcome = replace(outcome, message=f"{outcome.message} | {found}" if outcome.message else found)
        return Evaluated(outcome, built_ahead, self.devices[index])

    def abort(self) -> None:
        """Stop every job in flight now (their outcomes are discarded by the caller): kill the busy workers; each
        restarts on its next job. A trial being timed gets :data:`TIMING_GRACE_S` to finish first (a timing worker's
        restart costs a CUDA context and the imports), compiles in flight :data:`COMPILE_GRACE_S`: Triton's cache keeps
        what they build (the next bucket of the same head dims wants the same kernels: the sequence length is no
        specialisation), and their workers need no restart; jobs not yet started are not compiled."""
        with self._lock:
            self._generation += 1
            gen = self._generation - 1
        if self.pool is not None:
            self._later(COMPILE_GRACE_S, self.pool.kill_busy, gen)
        sanitize.kill_running()
        self._later(TIMING_GRACE_S, self._kill_timers, gen)

    def _later(self, seconds: float, fn: Callable[[int], None], gen: int) -> None:
        timer = threading.Timer(seconds, fn, args=(gen,))
        timer.daemon = True
        timer.start()
        self._grace.append(timer)

    def _kill_timers(self, gen: int) -> None:
        """Kill the timing workers still running a job of generation ``gen``."""
        with self._lock:  # held while closing: a worker that moved on to a newer job is not hit
            for index, tag in list(self._busy.items()):
                if tag == gen:
                    self.timers[index].close()

    def close(self) -> None:
        with self._lock:
            self._generation += 1
        for timer in self._grace:
            timer.cancel()
        sanitize.kill_running()
        if self.pool is not None:
            self.pool.close()
        for w in self.timers:
            w.close()
        self._threads.shutdown(wait=True, cancel_futures=True)
        for w in self.timers:
            w.close()
