"""The tuning loop (docs/DESIGN.md §3): one Optuna study per (kernel, GPU, dtype, shape), driven by a strategy.

For each shape a strategy (:mod:`dtune.tune.strategy`) proposes configs: ``pattern`` (:mod:`dtune.tune.pattern`,
the default for multi-stage kernels) plans them from the default, the space's seeds, configs transferred from the
nearest tuned buckets (:mod:`dtune.tune.transfer`) and one-parameter moves, stage by stage; the Optuna samplers
(``tpe``, the default for one-launch kernels, ``cmaes``, ``random``, ``grid``) ask the study, whose queue holds
the same starting configs (:mod:`dtune.tune.starts`). Each config becomes one trial:

constraints (violations are PRUNED with the constraint's name) -> resource model (configs predicted to spill
heavily or overflow shared memory are PRUNED, reason ``predicted``) -> compile (ahead, in parallel, with
``--compile-ahead``) -> gate -> time, on one timing worker per device (:mod:`dtune.tune.executor`).

The parent owns the study: every ``tell`` commits a trial to storage, ``trials.csv`` is rewritten after every
trial, and a trial in flight when the search stops is closed with its own reason (``cancelled`` when the time
budget ran out, ``interrupted`` on Ctrl-C): such trials never block their config and are retried on ``--resume``.
A config the study already evaluated is not run again (samplers: the new trial copies the earlier result,
``duplicate_of``; planned configs reuse it without a new trial). With an RDB storage (SQLite, PostgreSQL) every
process records heartbeats for its running trials and fails the stale trials of processes that died.

The parts, one job each: :mod:`~dtune.tune.search_config` (what a run is given), :mod:`~dtune.tune.shape_search`
(one shape's study and its run loop), :mod:`~dtune.tune.bookkeeping` (this process's trials: created, recorded,
told), :mod:`~dtune.tune.peers` (other processes on the study, heartbeats), :mod:`~dtune.tune.starts` (the starting
configs); this module drives them shape by shape (:func:`run_search`) and re-exports their public names.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from dtune.plugins import load_plugins
from dtune.tune import results, sanitize
from dtune.tune.bookkeeping import record
from dtune.tune.executor import Evaluator
from dtune.tune.interrupt import INTERRUPTED, on_sigint
from dtune.tune.runinfo import TRIALS_CSV, write_run_json
from dtune.tune.search_config import DEFAULT_TRIALS, INTERPRET_SHAPES, SearchConfig, run_info, worker_env
from dtune.tune.shape_search import ShapeSearch
from dtune.tune.storage import open_storage
from dtune.tune.strategy import SAMPLERS, STRATEGIES
from dtune.tune.summary import Reporter, RunSummary, ShapeSummary

__all__ = [
    "DEFAULT_TRIALS",
    "INTERPRET_SHAPES",
    "INTERRUPTED",
    "SAMPLERS",
    "STRATEGIES",
    "Reporter",
    "RunSummary",
    "SearchConfig",
    "ShapeSearch",
    "ShapeSummary",
    "record",
    "run_info",
    "run_search",
    "tune_shape",
    "worker_env",
]


def summarize(search: ShapeSearch, summary: ShapeSummary, finished: list[FrozenTrial]) -> None:
    summary.counts = results.counts(finished)
    summary.failures = results.failures_by_reason(finished)
    best = results.best_trial(finished)
    base = results.default_trial(finished)
    summary.best_ms = best.value if best is not None else None
    summary.best_config = best.user_attrs.get("config") if best is not None else None
    summary.default_ms = base.value if base is not None and results.passed(base) else None
    summary.model_hits, summary.model_checked = results.model_hits(finished)


def tune_shape(
    cfg: SearchConfig,
    search: ShapeSearch,
    summary: ShapeSummary,
    rows: dict[str, list[dict[str, Any]]],
    reporter: Reporter,
) -> None:
    """Run one shape's study within the budget; the CSV is rewritten after every trial."""
    t0 = time.monotonic()
    answered = [False]

    def out_of_time() -> bool:
        """The shape's budget is spent, and a trial has been answered, the default and the transferred configs too:
        a budget shorter than the first compiles (a cold cache, a new shape) runs on until those answers, at most
        ``trial_timeout`` longer, so that no shape ends with its best start untimed unless its trials hang (a
        tune-by-transfer of 10 s a bucket once timed only the template's default, 2-5x slower than the shipped
        config it then replaced)."""
        if INTERRUPTED.is_set() or (cfg.stop_at is not None and time.monotonic() >= cfg.stop_at):
            return True
        if cfg.timeout is None:
            return False
        spent = time.monotonic() - t0
        if spent < cfg.timeout:
            return False
        if not answered[0]:
            answered[0] = (search.evaluated > 0 or results.best_trial(search.finished()) is not None) and not (
                search.must_answer
            )
        return answered[0] or spent >= cfg.timeout + cfg.trial_timeout

    def should_stop() -> bool:
        return out_of_time() or (cfg.trials is not None and search.asked >= cfg.trials)

    def write_rows() -> None:
        rows[search.name] = search.rows()
        results.write_trials_csv(cfg.out / TRIALS_CSV, [r for rs in rows.values() for r in rs])

    def on_trial() -> None:
        summary.trials_run = search.asked
        summary.elapsed_s = time.monotonic() - t0
        finished = search.finished()
        summarize(search, summary, finished)
        summary.completed_run = search.completed
        write_rows()
        summary.last = rows[search.name][-1] if rows[search.name] else None
        reporter.trial_finished(summary)

    summarize(search, summary, search.finished())
    try:
        search.run(should_stop, on_trial, out_of_time)
    finally:
        summary.elapsed_s = time.monotonic() - t0
        summary.trials_run = search.asked
        write_rows()


def run_search(cfg: SearchConfig, reporter: Reporter | None = None) -> RunSummary:
    """Tune every shape of ``cfg``; returns the summary (also after Ctrl-C, with ``interrupted``)."""
    from dtune.tune.export import write_export

    reporter = reporter or Reporter()
    # the search records its trials' heartbeats itself (Peers.beat), not through Study.optimize
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    load_plugins()
    optuna.logging.set_verbosity(logging.ERROR)
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_run_json(cfg.out, run_info(cfg))
    storage = open_storage(cfg.storage_url)
    env = worker_env(cfg.interpret)
    sanitizer = sanitize.find_sanitizer() if cfg.sanitize and not cfg.interpret else None
    evaluator = Evaluator(
        env, cfg.out, cfg.trial_timeout, cfg.compile_ahead, cfg.worker_devices, not cfg.interpret, sanitizer
    )
    run = RunSummary(str(cfg.out), cfg.storage_url, cfg.kernel, cfg.gpu.key, cfg.dtype, cfg.interpret)
    run.strategy = cfg.strategy or ""
    rows: dict[str, list[dict[str, Any]]] = {}
    t_run = time.monotonic()
    INTERRUPTED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        for index, shape in enumerate(cfg.shapes):
            if INTERRUPTED.is_set() or (cfg.stop_at is not None and time.monotonic() >= cfg.stop_at):
                break
            search = ShapeSearch(cfg, shape, storage, evaluator)
            summary = ShapeSummary(search.name, shape.key)
            run.shapes.append(summary)
            reporter.shape_started(index, len(cfg.shapes), shape, summary, cfg.trials)
            tune_shape(cfg, search, summary, rows, reporter)
            reporter.shape_finished(summary)
    except KeyboardInterrupt:
        INTERRUPTED.set()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        run.interrupted = INTERRUPTED.is_set()
        evaluator.close()
        run.worker_restarts = evaluator.restarts
        run.elapsed_s = time.monotonic() - t_run
    write_export(cfg.out)
    return run
