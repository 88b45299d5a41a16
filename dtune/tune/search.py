"""The tuning loop (docs/DESIGN.md §3): one Optuna study per (kernel, GPU, dtype, shape), driven by ask/tell.

For each shape: the template's default config is enqueued first (the baseline), the space's seeds next,
then the sampler (TPE by default, seeded) proposes. Each trial: constraints (violations are PRUNED with
the constraint's name, before any compile) -> worker subprocess: compile (first launch) -> gate -> time.
The parent owns the study: every ``tell`` commits the trial to storage, and ``trials.csv`` is rewritten
after every trial, so Ctrl-C loses at most the trial in flight. A config the study already evaluated is
not run again: the new trial copies the earlier result (``duplicate_of``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from dtune.kernels import get_kernel
from optuna.exceptions import DuplicatedStudyError
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, Trial, TrialState

from dtune._env import child_env
from dtune.gpu import GpuProfile, device_name
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.timing import TIMINGS, timing_mode
from dtune.plugins import load_plugins
from dtune.shape import Shape, ShapeGrid
from dtune.tune import results
from dtune.tune.interrupt import INTERRUPTED, on_sigint, sigint_deferred
from dtune.tune.runinfo import TRIALS_CSV, git_commit, now_iso, versions, write_run_json
from dtune.tune.space import SearchSpace
from dtune.tune.storage import default_storage_url, open_storage, study_name
from dtune.tune.summary import Reporter, RunSummary, ShapeSummary
from dtune.tune.trials import TrialJob, TrialOutcome
from dtune.tune.worker import CompilePool, Worker

SAMPLERS = ("tpe", "cmaes", "random", "grid")
INTERPRET_SHAPES = ShapeGrid(seq_lens=(4,), head_dims=(32,), heads=(2,), batch=(2,))
DEFAULT_TRIALS = 40
_FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


@dataclass
class SearchConfig:
    """Everything one ``dtune search`` run needs (the CLI builds it from its options)."""

    kernel: str
    gpu: GpuProfile
    space: SearchSpace
    shapes: list[Shape]
    out: Path
    dtype: str = "bf16"
    trials: int | None = None  # per shape; with neither trials nor timeout: DEFAULT_TRIALS
    timeout: float | None = None  # seconds per shape
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None  # None: sqlite in the run folder
    resume: bool = False
    interpret: bool = False
    determinism: bool = False
    trial_timeout: float = 300.0
    repeats: int = 50
    timing: str = "auto"  # auto: graph replays for short sequences (T <= 16, launch-bound), events otherwise
    compile_ahead: int = 0  # compile workers running ahead of the timing worker (0: compile in the trial)
    workload: Workload = DEFAULT_WORKLOAD  # what each trial times (initial and final state by default)

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; use one of {', '.join(SAMPLERS)}")
        if self.dtype not in self.space.tolerance:
            raise ValueError(f"the search space has no tolerance for dtype {self.dtype!r}")
        if not self.shapes:
            raise ValueError("no shapes to tune")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"--trials must be at least 1, got {self.trials}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")
        if self.compile_ahead < 0:
            raise ValueError(f"--compile-ahead must be 0 or more, got {self.compile_ahead}")
        if self.timing not in TIMINGS:
            raise ValueError(f"unknown timing {self.timing!r}; use one of {', '.join(TIMINGS)}")
        if self.trials is None and self.timeout is None:
            self.trials = DEFAULT_TRIALS

    @property
    def device(self) -> str:
        return "cpu" if self.interpret else "cuda"

    @property
    def storage_url(self) -> str:
        return self.storage or default_storage_url(self.out)


def make_sampler(
    name: str, seed: int, choices: dict[str, tuple[Any, ...]], parallel: bool = False
) -> optuna.samplers.BaseSampler:
    """The sampler called ``name``, seeded. ``parallel``: trials are asked ahead (TPE lies about running ones)."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=parallel)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        # Parameters are categorical: CMA-ES samples them independently (through its fallback sampler).
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "grid":
        return optuna.samplers.GridSampler({n: list(c) for n, c in choices.items()}, seed=seed)
    raise ValueError(f"unknown sampler {name!r}; use one of {', '.join(SAMPLERS)}")


def worker_env(interpret: bool) -> dict[str, str]:
    """The workers' environment: this process's, with the interpreter switch, and the folder this dtune was imported
    from first on PYTHONPATH (so a search run from a source checkout starts workers of the same code)."""
    env = child_env()
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_info(cfg: SearchConfig) -> dict[str, Any]:
    return {
        "kernel": cfg.kernel,
        "gpu": cfg.gpu.as_dict(),
        "device_name": None if cfg.interpret else device_name(),  # what torch reported: provenance
        "dtype": cfg.dtype,
        "shapes": [s.as_dict() for s in cfg.shapes],
        "versions": versions(),
        "commit": git_commit(),
        "interpret": cfg.interpret,
        "sampler": cfg.sampler,
        "seed": cfg.seed,
        "storage": cfg.storage,  # None: study.db in this folder
        "space": cfg.space.source,
        "determinism": cfg.determinism,
        "timing": cfg.timing,
        "compile_ahead": cfg.compile_ahead,
        "workload": dataclasses.asdict(cfg.workload),
        "created": now_iso(),
    }


@dataclass
class Pending:
    """A trial asked and not yet told: its full config and, with a compile pool, its compile in flight."""

    trial: Trial
    config: dict[str, Any]
    compiled: Future[TrialOutcome] | None = None


def _key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


class ShapeSearch:
    """The study of one shape: enqueue the baseline, then ask -> evaluate -> tell until the budget is spent."""

    def __init__(self, cfg: SearchConfig, shape: Shape, storage: Any, worker: Worker) -> None:
        self.cfg, self.shape, self.worker = cfg, shape, worker
        self.spec = get_kernel(cfg.kernel)
        self.name = study_name(cfg.kernel, cfg.gpu.key, cfg.dtype, shape.key)
        self.default = self.spec.default_config(shape.K, shape.V)
        space = cfg.space.params
        self.choices = {
            n: tuple(sorted(set(space[n]) | ({self.default[n]} if n in self.default else set()))) for n in space
        }
        self.size = math.prod(len(c) for c in self.choices.values())
        self.asked = 0  # trials this process asked for (the --trials budget)
        exists = self.name in {s.study_name for s in storage.get_all_studies()}
        if exists and not cfg.resume:
            raise ValueError(
                f"study {self.name!r} already exists in {cfg.storage_url}; pass --resume to continue it "
                "(or choose another --out / --storage)"
            )
        try:  # exactly one process creates the study; only the creator enqueues the baseline and the seeds
            storage.create_new_study(directions=[StudyDirection.MINIMIZE], study_name=self.name)
            created = True
        except DuplicatedStudyError:
            created = False
        self.study = optuna.load_study(
            study_name=self.name,
            storage=storage,
            sampler=make_sampler(cfg.sampler, cfg.seed, self.choices, parallel=cfg.compile_ahead > 0),
        )
        if created:
            for key, value in self.meta().items():
                self.study.set_user_attr(key, value)
            self.study.set_user_attr("default_config", self.default)
            baseline = {n: self.default[n] for n in self.choices if n in self.default}
            self.study.enqueue_trial(baseline, user_attrs={"is_default": True}, skip_if_exists=True)
            for seed in cfg.space.seeds:
                self.study.enqueue_trial({**baseline, **seed}, skip_if_exists=True)

    def meta(self) -> dict[str, Any]:
        return {"kernel": self.cfg.kernel, "gpu": self.cfg.gpu.key, "dtype": self.cfg.dtype, **self.shape.as_dict()}

    def finished(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=_FINISHED)

    def rows(self) -> list[dict[str, Any]]:
        return results.trial_rows(self.name, self.meta(), self.study.get_trials(deepcopy=False))

    def exhausted(self, finished: list[FrozenTrial]) -> bool:
        return len({_key(t.params) for t in finished}) >= self.size

    def run(
        self,
        should_stop: Callable[[], bool],
        on_trial: Callable[[], None],
        pool: CompilePool | None,
        out_of_time: Callable[[], bool] = lambda: False,
    ) -> None:
        """Ask, evaluate and tell until ``should_stop()`` or the space is exhausted; ``on_trial`` after each tell.

        With a compile pool the loop asks ``pool.size`` trials ahead of the one being timed and has the pool
        compile them meanwhile (the timing worker then finds them in Triton's cache). Once ``out_of_time()``,
        the trials asked ahead are not run: each is closed as failed with reason ``cancelled`` (a time budget
        must not stretch by ``pool.size`` trials).
        """
        ahead = pool.size if pool is not None else 0
        pending: deque[Pending] = deque()
        try:
            while True:
                finished = self.finished()
                while len(pending) <= ahead and not should_stop() and not self.exhausted(finished):
                    with sigint_deferred():  # the trial exists in storage only once it is tracked in pending
                        trial = self.study.ask()
                        pending.append(Pending(trial, {}))  # closed as interrupted if anything below raises
                    self.asked += 1
                    item = self._prepare(trial, finished)
                    pending.pop()
                    if item is None:  # told at once: a duplicate or a constraint violation
                        on_trial()
                        finished = self.finished()
                        continue
                    if pool is not None:
                        item.compiled = pool.submit(self.job(trial.number, item.config, compile_only=True))
                    pending.append(item)
                if not pending:
                    return
                if out_of_time():
                    for item in pending:
                        item.trial.set_user_attr("reason", "cancelled")
                        item.trial.set_user_attr("message", "the time budget ran out before this trial ran")
                        self.study.tell(item.trial, state=TrialState.FAIL, skip_if_finished=True)
                        on_trial()
                    pending.clear()
                    return
                self._finish(pending[0])
                pending.popleft()
                on_trial()
        except BaseException:
            for item in pending:  # never leave a trial RUNNING in the storage
                if item.trial.number not in {t.number for t in self.finished()}:
                    item.trial.set_user_attr("reason", "crash")
                    item.trial.set_user_attr("message", "interrupted before the trial finished")
                    self.study.tell(item.trial, state=TrialState.FAIL, skip_if_finished=True)
            raise

    def _prepare(self, trial: Trial, finished: list[FrozenTrial]) -> Pending | None:
        """Suggest the params; tell at once a duplicate (copying the earlier result) or a constraint violation."""
        params = {n: trial.suggest_categorical(n, list(c)) for n, c in self.choices.items()}
        config = {**self.default, **params}
        is_default = bool(trial.user_attrs.get("is_default", False))
        trial.set_user_attr("config", config)
        trial.set_user_attr("is_default", is_default)
        earlier = {_key(t.params): t for t in finished if t.number != trial.number}.get(_key(params))
        if earlier is not None and not is_default:
            for key, value in earlier.user_attrs.items():
                if key not in ("is_default", "config"):
                    trial.set_user_attr(key, value)
            trial.set_user_attr("duplicate_of", earlier.number)
            self.study.tell(trial, earlier.value if earlier.state == TrialState.COMPLETE else None, state=earlier.state)
            return None
        # The baseline runs even if a constraint rejects it: every speedup is measured against it.
        violated = [] if is_default else self.cfg.space.violations(config, self.shape, self.cfg.gpu.constraint_fields())
        if violated:
            trial.set_user_attr("reason", "constraint")
            trial.set_user_attr("message", f"violates {', '.join(violated)}")
            trial.set_user_attr("gate_passed", False)
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        return Pending(trial, config)

    def _finish(self, item: Pending) -> None:
        """Compile (or collect the pool's compile), gate and time one trial in the worker; tell the study."""
        outcome = item.compiled.result() if item.compiled is not None else None
        if outcome is None or outcome.ok:
            outcome = self.worker.run(self.job(item.trial.number, item.config), self.cfg.trial_timeout)
        record(item.trial, outcome)
        if outcome.ok and outcome.time_ms is not None:
            self.study.tell(item.trial, outcome.time_ms)
        else:
            self.study.tell(item.trial, state=TrialState.FAIL)

    def job(self, number: int, config: dict[str, Any], compile_only: bool = False) -> TrialJob:
        cfg, s = self.cfg, self.shape
        return TrialJob(
            kernel=cfg.kernel,
            shape=s.bucket(),
            dtype=cfg.dtype,
            config=config,
            tolerance=cfg.space.tolerance[cfg.dtype],
            gate_seed=cfg.seed * 100_003 + number,
            determinism=cfg.determinism,
            device=cfg.device,
            warmup=1 if cfg.interpret else 5,
            repeats=3 if cfg.interpret else cfg.repeats,
            timing=timing_mode(cfg.timing, s.T),
            compile_only=compile_only,
            initial_state=cfg.workload.initial_state,
            final_state=cfg.workload.final_state,
        )


def record(trial: Trial, outcome: TrialOutcome) -> None:
    """Keep the outcome on the trial (the CSV and the export read these attributes)."""
    for key in results.OUTCOME_ATTRS:
        trial.set_user_attr(key, getattr(outcome, key))
    trial.set_user_attr("gate_passed", outcome.ok)


def summarize(search: ShapeSearch, summary: ShapeSummary, finished: list[FrozenTrial]) -> None:
    summary.counts = results.counts(finished)
    summary.failures = results.failures_by_reason(finished)
    best = results.best_trial(finished)
    base = results.default_trial(finished)
    summary.best_ms = best.value if best is not None else None
    summary.best_config = best.user_attrs.get("config") if best is not None else None
    summary.default_ms = base.value if base is not None and results.passed(base) else None


def tune_shape(
    cfg: SearchConfig,
    search: ShapeSearch,
    summary: ShapeSummary,
    pool: CompilePool | None,
    rows: dict[str, list[dict[str, Any]]],
    reporter: Reporter,
) -> None:
    """Run one shape's study within the budget; the CSV is rewritten after every trial."""
    t0 = time.monotonic()

    def out_of_time() -> bool:
        return INTERRUPTED.is_set() or (cfg.timeout is not None and time.monotonic() - t0 >= cfg.timeout)

    def should_stop() -> bool:
        return out_of_time() or (cfg.trials is not None and search.asked >= cfg.trials)

    def write_rows() -> None:
        rows[search.name] = search.rows()
        results.write_trials_csv(cfg.out / TRIALS_CSV, [r for rs in rows.values() for r in rs])

    def on_trial() -> None:
        summary.trials_run += 1
        summary.elapsed_s = time.monotonic() - t0
        summarize(search, summary, search.finished())
        write_rows()
        summary.last = rows[search.name][-1] if rows[search.name] else None
        reporter.trial_finished(summary)

    summarize(search, summary, search.finished())
    try:
        search.run(should_stop, on_trial, pool, out_of_time)
    finally:
        summary.elapsed_s = time.monotonic() - t0
        write_rows()


def run_search(cfg: SearchConfig, reporter: Reporter | None = None) -> RunSummary:
    """Tune every shape of ``cfg``; returns the summary (also after Ctrl-C, with ``interrupted``)."""
    from dtune.tune.export import write_export

    reporter = reporter or Reporter()
    load_plugins()
    optuna.logging.set_verbosity(logging.ERROR)
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_run_json(cfg.out, run_info(cfg))
    storage = open_storage(cfg.storage_url)
    env = worker_env(cfg.interpret)
    worker = Worker(env=env, log_path=cfg.out / "worker.log")
    pool = CompilePool(cfg.compile_ahead, env, cfg.out, cfg.trial_timeout) if cfg.compile_ahead > 0 else None
    run = RunSummary(str(cfg.out), cfg.storage_url, cfg.kernel, cfg.gpu.key, cfg.dtype, cfg.interpret)
    rows: dict[str, list[dict[str, Any]]] = {}
    t_run = time.monotonic()
    INTERRUPTED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        for index, shape in enumerate(cfg.shapes):
            if INTERRUPTED.is_set():
                break
            search = ShapeSearch(cfg, shape, storage, worker)
            summary = ShapeSummary(search.name, shape.key)
            run.shapes.append(summary)
            reporter.shape_started(index, len(cfg.shapes), shape, summary, cfg.trials)
            tune_shape(cfg, search, summary, pool, rows, reporter)
            reporter.shape_finished(summary)
    except KeyboardInterrupt:
        INTERRUPTED.set()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        run.interrupted = INTERRUPTED.is_set()
        if pool is not None:
            pool.close()
        worker.close()
        run.worker_restarts = worker.restarts
        run.elapsed_s = time.monotonic() - t_run
    write_export(cfg.out)
    return run
