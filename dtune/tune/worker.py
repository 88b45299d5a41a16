"""Trial isolation: each trial runs in a worker subprocess (``python -m dtune.tune.worker``), so a config that
hangs the GPU or kills the process costs one trial, never the study.

Protocol: the parent writes one JSON :class:`~dtune.tune.trials.TrialJob` per line on the worker's stdin; the
worker answers one JSON :class:`~dtune.tune.trials.TrialOutcome` per line on its stdout (its original fd 1; anything
else the process prints goes to stderr, which the parent sends to a log file). The worker announces
``{"ready": ...}`` once torch, triton and the plugins are imported. A worker that dies mid-trial is a
``crash``; one that does not answer within the trial timeout is killed: ``timeout``. Either way the next
trial starts a fresh worker. After a runtime error or an untyped exception on a GPU the worker exits on
purpose (the CUDA context may be corrupt: an illegal memory access poisons every later launch) and is
restarted too.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from dtune.tune.memory import CompileMemory
from dtune.tune.trials import TrialJob, TrialOutcome

STARTUP_TIMEOUT_S = 300.0


class WorkerError(RuntimeError):
    """The worker could not be started (its log tail is in the message)."""


class Worker:
    """A restartable worker subprocess evaluating one job at a time with a time limit."""

    def __init__(self, env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="dtune-worker-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._log: IO[bytes] | None = None

    def _start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        log_start = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtune.tune.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=self.env,
        )
        reply = self._read(STARTUP_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            self.close()
            tail = self.log_path.read_bytes()[log_start:].decode("utf-8", errors="replace").strip()[-1500:]
            raise WorkerError(f"the trial worker failed to start: {tail or 'no output'}")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """One reply line, or None if the worker died or stayed silent for ``timeout`` seconds."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            return None
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, job: TrialJob, timeout: float) -> TrialOutcome:
        """Evaluate ``job``; a dead or silent worker becomes a ``crash`` or ``timeout`` outcome."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.restarts += 1
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        log_start = self.log_path.stat().st_size
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write((json.dumps(job.__dict__) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(timeout)
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if reply is not None:
            return TrialOutcome.from_dict(reply)
        elapsed = time.perf_counter() - t0
        alive = self.proc.poll() is None
        self.close()
        tail = _tail_since(self.log_path, log_start)
        if alive and elapsed >= timeout * 0.99:
            return TrialOutcome(reason="timeout", message=f"no result after {timeout:g} s: worker killed")
        code = self.proc.returncode if self.proc is not None else None
        return TrialOutcome(reason="crash", message=f"worker died (exit code {code}): {tail}".strip())

    def close(self) -> None:
        """Stop the worker (kill: it may be hung) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def _tail_since(path: Path, start: int, n: int = 1500) -> str:
    try:
        data = path.read_bytes()[start:]
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace").strip()[-n:]


def must_restart(reason: str | None, device: str) -> bool:
    """Whether the worker must exit after a trial that failed with ``reason``: any error raised on a GPU at run time
    (a launch failure, or an exception evaluate did not type, such as an illegal memory access) may leave the CUDA
    context unusable, and every later trial in this process would fail too (H200, 2026-11-29: 7 trials in a row)."""
    return reason in ("runtime", "crash") and device.startswith("cuda")


def main() -> None:
    """Worker loop: jobs on stdin, outcomes on the original stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops this worker
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (Python or C) go to the log, not into the protocol
    sys.stdout = sys.stderr

    import dtune.ops  # noqa: F401  (torch, triton and the kernels, before announcing readiness)
    from dtune.plugins import load_plugins
    from dtune.tune.trials import evaluate

    load_plugins()
    proto.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = TrialJob(**json.loads(line))
        try:
            outcome = evaluate(job)
        except Exception as e:  # evaluate types its failures; anything else is a bug worth a record
            outcome = TrialOutcome(reason="crash", message=f"{type(e).__name__}: {e}")
        proto.write(json.dumps(outcome.as_dict()) + "\n")
        if must_restart(outcome.reason, job.device):
            sys.exit(0)  # a failed launch may leave the CUDA context unusable: start fresh


if __name__ == "__main__":
    main()


class CompilePool:
    """Workers that compile trials ahead of the timing worker (Triton's on-disk cache carries the binaries over).

    ``submit`` takes a ``compile_only`` job and returns a future outcome: a compile failure is the trial's
    result; a success means the timing worker's first launch will find the kernels already built.
    """

    def __init__(
        self, size: int, env: dict[str, str], log_dir: Path, timeout: float, memory: CompileMemory | None = None
    ) -> None:
        """``memory``: the GPU memory admission of the jobs (:mod:`dtune.tune.memory`; None: no limit)."""
        self.size = size
        self.timeout = timeout
        self.memory = memory or CompileMemory(None)
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._all = [Worker(env=env, log_path=log_dir / f"compile-{i}.log") for i in range(size)]
        for w in self._all:
            self._idle.put(w)
        self._busy: dict[int, int] = {}  # id(worker) -> the tag of the job it compiles
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="dtune-compile")

    def submit(self, job: TrialJob, tag: int = 0, skip: Callable[[], bool] | None = None) -> Future[TrialOutcome]:
        """Compile ``job`` on the next idle worker. ``tag``: what :meth:`kill_busy` picks the job by; ``skip()``
        true when a worker frees up for it: not compiled (the search no longer wants it)."""

        def task() -> TrialOutcome:
            weight = self.memory.weight(job)
            if not self.memory.acquire(weight, wanted=lambda: skip is None or not skip()):
                return TrialOutcome(reason="cancelled", message="not compiled: the search stopped first")
            outcome: TrialOutcome | None = None
            try:
                worker = self._idle.get()
                if skip is not None and skip():
                    self._idle.put(worker)
                    return TrialOutcome(reason="cancelled", message="not compiled: the search stopped first")
                with self._lock:
                    self._busy[id(worker)] = tag
                try:
                    outcome = worker.run(job, self.timeout)
                    return outcome
                except WorkerError as e:
                    return TrialOutcome(reason="crash", message=str(e))
                finally:
                    with self._lock:
                        self._busy.pop(id(worker), None)
                    self._idle.put(worker)
            finally:
                self.memory.release(weight, job, outcome)

        return self._executor.submit(task)

    def kill_busy(self, tag: int | None = None) -> None:
        """Stop the compiles in flight (of jobs submitted with ``tag``; None: all): their workers restart on their
        next job."""
        with self._lock:  # held while closing: a worker that moved on to a job of another tag is not hit
            for w in self._all:
                if id(w) in self._busy and (tag is None or self._busy[id(w)] == tag):
                    w.close()

    def close(self) -> None:
        """Stop every compile worker (killing any compile in flight) and the threads."""
        for w in self._all:
            w.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        for w in self._all:
            w.close()
