"""The tuning loop (docs/DESIGN.md §3): one Optuna study per (kernel, GPU, dtype, shape), driven by a strategy.

For each shape a strategy (:mod:`dtune.tune.strategy`) proposes configs: ``pattern`` (:mod:`dtune.tune.pattern`,
the default for multi-stage kernels) plans them from the default, the space's seeds, configs transferred from the
nearest tuned buckets (:mod:`dtune.tune.transfer`) and one-parameter moves, stage by stage; the Optuna samplers
(``tpe``, the default for one-launch kernels, ``cmaes``, ``random``, ``grid``) ask the study, whose queue holds
the same starting configs. Each config becomes one trial:

constraints (violations are PRUNED with the constraint's name) -> resource model (configs predicted to spill
heavily or overflow shared memory are PRUNED, reason ``predicted``) -> compile (ahead, in parallel, with
``--compile-ahead``) -> gate -> time, on one timing worker per device (:mod:`dtune.tune.executor`).

The parent owns the study: every ``tell`` commits a trial to storage, ``trials.csv`` is rewritten after every
trial, and a trial in flight when the search stops is closed with its own reason (``cancelled`` when the time
budget ran out, ``interrupted`` on Ctrl-C): such trials never block their config and are retried on ``--resume``.
A config the study already evaluated is not run again (samplers: the new trial copies the earlier result,
``duplicate_of``; planned configs reuse it without a new trial). With an RDB storage (SQLite, PostgreSQL) every
process records heartbeats for its running trials and fails the stale trials of processes that died.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from dtune.kernels import get_kernel
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.exceptions import DuplicatedStudyError
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, Trial, TrialState

from dtune._env import child_env
from dtune.gpu import GpuProfile, device_name
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.timing import TIMINGS, timing_mode
from dtune.plugins import load_plugins
from dtune.shape import Shape, ShapeGrid
from dtune.tune import resource_model, results, sanitize, transfer
from dtune.tune.executor import Evaluated, Evaluator
from dtune.tune.interrupt import INTERRUPTED, on_sigint, sigint_deferred
from dtune.tune.pattern import PatternSearch
from dtune.tune.runinfo import TRIALS_CSV, git_commit, now_iso, versions, write_run_json
from dtune.tune.space import SearchSpace
from dtune.tune.storage import HEARTBEAT_S, default_storage_url, open_storage, reap_stale, record_heartbeats, study_name
from dtune.tune.strategy import (
    SAMPLERS,
    STRATEGIES,
    Candidate,
    Measured,
    Result,
    SamplerStrategy,
    Strategy,
    make_sampler,
)
from dtune.tune.summary import Reporter, RunSummary, ShapeSummary
from dtune.tune.trials import RETRYABLE, TrialJob

__all__ = ["DEFAULT_TRIALS", "INTERPRET_SHAPES", "SAMPLERS", "STRATEGIES", "SearchConfig", "run_search"]

INTERPRET_SHAPES = ShapeGrid(seq_lens=(4,), head_dims=(32,), heads=(2,), batch=(2,))
DEFAULT_TRIALS = 40
POLL_S = 0.5  # the loop's wake-up: budgets, heartbeats, trials other processes run
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
    trials: int | None = None  # per shape, run by this process; with neither trials nor timeout: DEFAULT_TRIALS
    timeout: float | None = None  # seconds per shape
    strategy: str | None = None  # None: "pattern" when the space has a stage map (multi-launch kernels), else "tpe"
    seed: int = 0
    storage: str | None = None  # None: sqlite in the run folder
    resume: bool = False
    interpret: bool = False
    determinism: bool = False
    trial_timeout: float = 300.0
    repeats: int = 50
    timing: str = "auto"  # auto: graph replays for short sequences (T <= 16, launch-bound), events otherwise
    compile_ahead: int = 0  # compile workers running ahead of the timing workers (0: each trial compiles in turn)
    workload: Workload = DEFAULT_WORKLOAD  # what each trial times (initial and final state by default)
    seeds: bool = True  # start from the space's seeds and the shipped configs' nearest buckets too (False: default)
    transfer_from: tuple[Path, ...] = ()  # run folders whose winners seed the nearest buckets (also with seeds off)
    transfer_count: int = transfer.DEFAULT_COUNT
    devices: tuple[str, ...] = ()  # one timing worker per entry (CUDA_VISIBLE_DEVICES); () one, as the env says
    resource_model: bool = True  # drop configs predicted to spill heavily or to overflow shared memory
    sanitize: bool = True  # re-run a crashed trial under compute-sanitizer (when installed; not under the interpreter)
    max_memory_mb: float | None = None  # trials whose training step / call peaks above this (MiB) fail, reason "memory"
    sampler: str | None = None  # deprecated alias of strategy

    def __post_init__(self) -> None:
        if self.sampler is not None:
            if self.strategy is not None and self.strategy != self.sampler:
                raise ValueError("give --strategy or its deprecated alias --sampler, not both")
            self.strategy = self.sampler
        if self.strategy is None:
            self.strategy = "pattern" if self.space.stages else "tpe"
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
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
        if self.transfer_count < 0:
            raise ValueError(f"--transfer-count must be 0 or more, got {self.transfer_count}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"--devices lists a device twice: {','.join(self.devices)}")
        for path in self.transfer_from:
            if not (Path(path) / "run.json").is_file():
                raise ValueError(f"--transfer-from {path}: not a run folder (no run.json)")
        if self.max_memory_mb is not None and not self.max_memory_mb > 0:
            raise ValueError(f"--max-memory must be positive, got {self.max_memory_mb}")
        if self.trials is None and self.timeout is None:
            self.trials = DEFAULT_TRIALS

    @property
    def device(self) -> str:
        return "cpu" if self.interpret else "cuda"

    @property
    def storage_url(self) -> str:
        return self.storage or default_storage_url(self.out)

    @property
    def worker_devices(self) -> list[str | None]:
        """One entry per timing worker: a CUDA device index (under the interpreter only a label), or None."""
        return list(self.devices) if self.devices else [None]


def worker_env(interpret: bool) -> dict[str, str]:
    """The workers' environment: this process's, with the interpreter switch, and the folder this dtune was imported
    from first on PYTHONPATH (so a search run from a source checkout starts workers of the same code). Every worker
    (compile pool and timing workers) gets the same Triton cache directory: what the pool builds, the timing
    workers load."""
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
        "strategy": cfg.strategy,
        "sampler": cfg.strategy,  # the report's name for it
        "seed": cfg.seed,
        "seeds": cfg.seeds,
        "transfer_from": [str(p) for p in cfg.transfer_from],
        "storage": cfg.storage,  # None: study.db in this folder
        "space": cfg.space.source,
        "determinism": cfg.determinism,
        "timing": cfg.timing,
        "compile_ahead": cfg.compile_ahead,
        "devices": list(cfg.devices),
        "resource_model": cfg.resource_model,
        "workload": dataclasses.asdict(cfg.workload),
        "created": now_iso(),
    }


def _key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


def retryable(t: FrozenTrial) -> bool:
    """A trial that never ran to its end (cancelled, interrupted, or failed stale because its process died)."""
    reason = t.user_attrs.get("reason")
    return reason in RETRYABLE or (t.state == TrialState.FAIL and reason is None)


@dataclass
class Pending:
    """A trial created and not yet told: its candidate, full config and the evaluation in flight."""

    trial: Trial
    candidate: Candidate
    config: dict[str, Any] = field(default_factory=dict)
    future: Future[Evaluated] | None = None


@dataclass
class Elsewhere:
    """A planned config another process is running: its result is awaited instead of running it again."""

    candidate: Candidate
    number: int
    since: float


class ShapeSearch:
    """The study of one shape: the strategy proposes, this runs and tells, until the budget is spent."""

    def __init__(self, cfg: SearchConfig, shape: Shape, storage: BaseStorage, evaluator: Evaluator) -> None:
        self.cfg, self.shape, self.evaluator = cfg, shape, evaluator
        self.spec = get_kernel(cfg.kernel)
        self.name = study_name(cfg.kernel, cfg.gpu.key, cfg.dtype, shape.key)
        self.default = self.spec.default_config(shape.K, shape.V)
        space = cfg.space.params
        self.choices = {
            n: tuple(sorted(set(space[n]) | ({self.default[n]} if n in self.default else set()), key=_order))
            for n in space
        }
        self.baseline = {n: self.default[n] for n in self.choices if n in self.default}
        self.size = math.prod(len(c) for c in self.choices.values())
        self.gpu_fields = cfg.gpu.constraint_fields()
        self.asked = 0  # trials this process created (the --trials budget)
        self.open: dict[int, Pending] = {}  # this process's trials not yet told
        self.completed = 0  # trials this process gated and timed (the throughput figure)
        self.last_beat = 0.0
        exists = self.name in {s.study_name for s in storage.get_all_studies()}
        if exists and not cfg.resume:
            raise ValueError(
                f"study {self.name!r} already exists in {cfg.storage_url}; pass --resume to continue it "
                "(or choose another --out / --storage)"
            )
        try:  # exactly one process creates the study; only the creator enqueues the starting configs
            storage.create_new_study(directions=[StudyDirection.MINIMIZE], study_name=self.name)
            created = True
        except DuplicatedStudyError:
            created = False
        assert cfg.strategy is not None
        sampler = make_sampler(cfg.strategy, cfg.seed, self.choices, parallel=evaluator.capacity > 1)
        self.study = optuna.load_study(study_name=self.name, storage=storage, sampler=sampler)
        reap_stale(self.study)
        if created:
            for key, value in self.meta().items():
                self.study.set_user_attr(key, value)
            self.study.set_user_attr("default_config", self.default)
        starts = self.starts()
        self.strategy: Strategy
        if cfg.strategy == "pattern":
            self.strategy = PatternSearch(self.choices, starts, cfg.space.stages, self.legal)
        else:
            self.strategy = SamplerStrategy()
            if created or cfg.resume:
                for c in starts:
                    if c.source == "resume":
                        continue
                    attrs = {"is_default": c.is_default, "source": c.source}
                    if created or c.source == "retry":
                        self.study.enqueue_trial(c.params or {}, user_attrs=attrs, skip_if_exists=c.source != "retry")

    # ---- the starting configs ------------------------------------------------------------------------------
    def starts(self) -> list[Candidate]:
        """The default first, then the space's seeds and the nearest tuned buckets' winners (unless seeds are off),
        configs of runs given with --transfer-from, and on --resume the study's best and its trials to retry."""
        cfg = self.cfg
        out = [Candidate(dict(self.baseline), source="default", is_default=True)]
        if cfg.seeds:
            out += [Candidate({**self.baseline, **s}, source="seed") for s in cfg.space.seeds]
        donors: list[transfer.Donor] = transfer.shipped_donors() if cfg.seeds else []
        for run_dir in (*cfg.transfer_from, cfg.out):
            donors += transfer.run_donors(Path(run_dir))
        here = (cfg.kernel, cfg.gpu.key, cfg.dtype, self.shape.bucket())
        donors = [d for d in donors if (d.kernel, d.gpu, d.dtype, d.bucket) != here]  # not this study itself
        for d in transfer.nearest(donors, cfg.kernel, cfg.gpu.key, cfg.dtype, self.shape, cfg.transfer_count):
            params = {n: v for n, v in d.config.items() if n in self.choices and v in self.choices[n]}
            out.append(Candidate({**self.baseline, **params}, source="transfer:" + d.describe()))
        if cfg.resume:
            trials = self.study.get_trials(deepcopy=False)
            best = results.best_trial(trials)
            if best is not None:
                out.append(Candidate(dict(best.params), source="resume"))
            done = {_key(t.params) for t in trials if t.state in _FINISHED and not retryable(t)}
            for t in trials:
                if t.state in _FINISHED and retryable(t) and _key(t.params) not in done:
                    done.add(_key(t.params))
                    out.append(Candidate(dict(t.params), source="retry"))
        return out

    # ---- helpers -------------------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {"kernel": self.cfg.kernel, "gpu": self.cfg.gpu.key, "dtype": self.cfg.dtype, **self.shape.as_dict()}

    def legal(self, params: dict[str, Any]) -> bool:
        return not self.cfg.space.violations({**self.default, **params}, self.shape, self.gpu_fields)

    def finished(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=_FINISHED)

    def rows(self) -> list[dict[str, Any]]:
        return results.trial_rows(self.name, self.meta(), self.study.get_trials(deepcopy=False))

    def exhausted(self, finished: list[FrozenTrial]) -> bool:
        return len({_key(t.params) for t in finished}) >= self.size

    def job(self, number: int, config: dict[str, Any], c: Candidate) -> TrialJob:
        cfg, s = self.cfg, self.shape
        stage = c.kind == "stage"
        return TrialJob(
            kernel=cfg.kernel,
            shape=s.bucket(),
            dtype=cfg.dtype,
            config=config,
            tolerance=cfg.space.tolerance[cfg.dtype],
            # one input set per shape for stage-local moves, another for whole trials (fresh inputs for every config
            # that may be exported); each worker computes their float64 reference once
            gate_seed=cfg.seed * 100_003 + (0 if stage else 1),
            determinism=cfg.determinism,
            device=cfg.device,
            warmup=1 if cfg.interpret else 5,
            repeats=3 if cfg.interpret else cfg.repeats,
            timing=timing_mode(cfg.timing, s.T),
            initial_state=cfg.workload.initial_state,
            final_state=cfg.workload.final_state,
            kind=c.kind,
            stage=c.stage,
            stage_launches=cfg.space.stages.launch_table(),
            edge=not stage,
            reuse_inputs=True,
            seq_lens=list(cfg.workload.seq_lens) if cfg.workload.seq_lens else None,
            max_memory_mb=cfg.max_memory_mb,
        )

    # ---- what the study already knows ----------------------------------------------------------------------
    def known(self, c: Candidate, trials: list[FrozenTrial]) -> Result | None:
        """A finished trial of the same config that answers ``c`` (none that never ran to its end)."""
        assert c.params is not None
        k = _key(c.params)
        for t in trials:
            if t.state not in _FINISHED or _key(t.params) != k or retryable(t):
                continue
            if t.user_attrs.get("reason") == "claimed":
                continue
            if t.state != TrialState.COMPLETE or not results.passed(t, allow_stage=True):
                return self.result_of(c, t, reused=True)
            stage_ms = t.user_attrs.get("stage_ms") or {}
            if c.kind == "whole" and results.is_whole(t):
                return self.result_of(c, t, reused=True)
            if c.kind == "stage" and c.stage in stage_ms:
                return self.result_of(c, t, reused=True)
        return None

    def running_elsewhere(self, c: Candidate, trials: list[FrozenTrial]) -> int | None:
        assert c.params is not None
        k = _key(c.params)
        for t in trials:
            mine = t.number in self.open
            if t.state == TrialState.RUNNING and not mine and _key(t.params) == k and _kind(t) == c.kind:
                return t.number
        return None

    def result_of(self, c: Candidate, t: FrozenTrial, reused: bool = False) -> Result:
        ok = t.state == TrialState.COMPLETE and results.passed(t, allow_stage=True)
        stage_ms = dict(t.user_attrs.get("stage_ms") or {})
        value = t.value if ok else None
        if ok and c.kind == "stage":
            value = _estimate(c, stage_ms)
        elif ok and c.kind == "whole" and not results.is_whole(t):
            ok, value = False, None
        return Result(c, dict(t.params), ok, value, stage_ms, t.number, t.user_attrs.get("reason"), reused)

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(
        self,
        should_stop: Callable[[], bool],
        on_trial: Callable[[], None],
        out_of_time: Callable[[], bool] = lambda: False,
    ) -> None:
        """Propose, evaluate and tell until the strategy is done, ``should_stop()`` or the space is exhausted;
        ``on_trial`` after each tell. Once ``out_of_time()`` the trials in flight are closed as ``cancelled``
        (a time budget must not stretch by the trials compiled ahead)."""
        in_flight: dict[Future[Evaluated], Pending] = {}
        elsewhere: list[Elsewhere] = []
        capacity = self.evaluator.capacity
        done = False
        try:
            while True:
                self.beat()
                if out_of_time():
                    self.close_open("cancelled", "the time budget ran out before this trial finished", on_trial)
                    self.evaluator.abort()
                    return
                trials = self.study.get_trials(deepcopy=False)
                self.poll_elsewhere(elsewhere, trials)
                progressed = False
                while not done and len(in_flight) + len(elsewhere) < capacity and not self.stopping(should_stop):
                    cands = self.strategy.propose(capacity - len(in_flight) - len(elsewhere))
                    if cands is None:
                        done = True
                        break
                    if not cands:
                        break
                    progressed = True
                    for c in cands:
                        if self.stopping(should_stop):
                            break
                        self.start(c, trials, in_flight, elsewhere, on_trial)
                        if c.params is None or self.open:
                            trials = self.study.get_trials(deepcopy=False)
                if not in_flight and not elsewhere:
                    if done or self.stopping(should_stop) or not progressed:
                        return
                    continue
                if not in_flight:
                    time.sleep(POLL_S)
                    continue
                finished, _ = wait(list(in_flight), timeout=POLL_S, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item = in_flight.pop(fut)
                    self.finish(item, fut.result())
                    on_trial()
        except BaseException:
            self.close_open("interrupted", "interrupted before the trial finished", on_trial=None)
            self.evaluator.abort()
            raise

    def stopping(self, should_stop: Callable[[], bool]) -> bool:
        return should_stop() or self.exhausted(self.finished())

    def start(
        self,
        c: Candidate,
        trials: list[FrozenTrial],
        in_flight: dict[Future[Evaluated], Pending],
        elsewhere: list[Elsewhere],
        on_trial: Callable[[], None],
    ) -> None:
        """Create the trial of ``c`` (or answer it from the study), check it, and submit it."""
        if c.params is not None:
            known = self.known(c, trials)
            if known is not None:
                self.strategy.observe(known)
                return
            other = self.running_elsewhere(c, trials)
            if other is not None:
                elsewhere.append(Elsewhere(c, other, time.monotonic()))
                return
        with sigint_deferred():  # the trial exists in storage only once it is tracked in self.open
            trial = self.study.ask() if c.params is None else self.create_trial(c.params)
            item = Pending(trial, c)
            self.open[trial.number] = item
        record_heartbeats(self.study, [trial])  # from its first moment: a process killed now leaves a stale trial
        self.asked += 1
        if c.params is not None:
            first = self.claimed_first(trial, c)
            if first is not None:  # another process created the same trial just before: it runs it, this one waits
                trial.set_user_attr("reason", "claimed")
                trial.set_user_attr("message", f"trial {first} of another process runs this config")
                trial.set_user_attr("kind", c.kind)
                self.study.tell(trial, state=TrialState.PRUNED)
                del self.open[trial.number]
                elsewhere.append(Elsewhere(c, first, time.monotonic()))
                on_trial()
                return
        if c.params is None:  # a sampler's pick (or a config the creator enqueued)
            params = {n: trial.suggest_categorical(n, list(ch)) for n, ch in self.choices.items()}
            attrs = trial.user_attrs
            c = Candidate(params, source=str(attrs.get("source", "sampler")), is_default=bool(attrs.get("is_default")))
            item.candidate = c
        else:
            params = {n: trial.suggest_categorical(n, list(ch)) for n, ch in self.choices.items()}
        config = {**self.default, **params}
        item.config = config
        for key, value in self.trial_attrs(c, config).items():
            trial.set_user_attr(key, value)
        if c.kind == "whole" and c.source == "sampler":
            earlier = {
                _key(t.params): t
                for t in self.finished()
                if not retryable(t) and t.number != trial.number and t.user_attrs.get("reason") != "claimed"
            }
            dup = earlier.get(_key(params))
            if dup is not None and not c.is_default:
                self.tell_duplicate(item, dup)
                on_trial()
                return
        reason, message = self.rejected(c, config)
        if reason is not None:
            trial.set_user_attr("reason", reason)
            trial.set_user_attr("message", message)
            trial.set_user_attr("gate_passed", False)
            self.study.tell(trial, state=TrialState.PRUNED)
            del self.open[trial.number]
            self.strategy.observe(Result(c, params, False, number=trial.number, reason=reason))
            on_trial()
            return
        item.future = self.evaluator.submit(self.job(trial.number, config, c))
        in_flight[item.future] = item

    def claimed_first(self, trial: Trial, c: Candidate) -> int | None:
        """The number of an earlier trial of another process for the same planned config (two processes checked the
        study at the same moment and both created one): the later one yields, so no config is measured twice."""
        assert c.params is not None
        k = _key(c.params)
        for t in self.study.get_trials(deepcopy=False):
            if t.number >= trial.number or t.number in self.open or _key(t.params) != k or _kind(t) != c.kind:
                continue
            live = t.state == TrialState.RUNNING or (t.state in _FINISHED and not retryable(t))
            if live and t.user_attrs.get("reason") != "claimed":
                return t.number
        return None

    def create_trial(self, params: dict[str, Any]) -> Trial:
        """A RUNNING trial with ``params`` already set (not through the study's queue of enqueued trials, which any
        process sharing the study may pop)."""
        dists: dict[str, BaseDistribution] = {n: CategoricalDistribution(list(self.choices[n])) for n in params}
        template = FrozenTrial(
            number=0,
            state=TrialState.RUNNING,
            value=None,
            datetime_start=datetime.datetime.now(),
            datetime_complete=None,
            params=dict(params),
            distributions=dists,
            user_attrs={},
            system_attrs={},
            intermediate_values={},
            trial_id=0,
        )
        trial_id = self.study._storage.create_new_trial(self.study._study_id, template_trial=template)
        return Trial(self.study, trial_id)

    def trial_attrs(self, c: Candidate, config: dict[str, Any]) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "config": config,
            "is_default": c.is_default,
            "kind": c.kind,
            "source": c.source,
        }
        if c.stage is not None:
            attrs["stage"] = c.stage
        if c.base is not None:
            attrs["base_trial"] = c.base.number
        pred = resource_model.predict(self.cfg.kernel, config, self.shape.K, self.shape.V, self.cfg.dtype)
        if pred is not None:
            attrs["predicted"] = {n: [round(p.registers), p.shared, p.cap] for n, p in pred.items()}
            attrs["pred_spill"] = resource_model.predicted_spills(pred)
        return attrs

    def rejected(self, c: Candidate, config: dict[str, Any]) -> tuple[str | None, str]:
        """Why the config is pruned before compiling: a constraint, or the resource model (never the baseline)."""
        if c.is_default:  # every speedup is measured against it
            return None, ""
        violated = self.cfg.space.violations(config, self.shape, self.gpu_fields)
        if violated:
            return "constraint", f"violates {', '.join(violated)}"
        if self.cfg.resource_model:
            pred = resource_model.predict(self.cfg.kernel, config, self.shape.K, self.shape.V, self.cfg.dtype)
            why = resource_model.drop_reason(pred, self.cfg.gpu.smem_per_block)
            if why is not None:
                return "predicted", why
        return None, ""

    def tell_duplicate(self, item: Pending, earlier: FrozenTrial) -> None:
        trial = item.trial
        for key, value in earlier.user_attrs.items():
            if key not in ("is_default", "config", "source"):
                trial.set_user_attr(key, value)
        trial.set_user_attr("duplicate_of", earlier.number)
        value = earlier.value if earlier.state == TrialState.COMPLETE else None
        self.study.tell(trial, value, state=earlier.state)
        del self.open[trial.number]
        self.strategy.observe(self.result_of(item.candidate, earlier, reused=True))

    def finish(self, item: Pending, ev: Evaluated) -> None:
        """Record the evaluation on the trial, tell the study and the strategy."""
        outcome, trial, c = ev.outcome, item.trial, item.candidate
        record(trial, outcome)
        trial.set_user_attr("built_ahead", ev.built_ahead)
        trial.set_user_attr("device", ev.device)
        pred = trial.user_attrs.get("predicted")
        if pred is not None and outcome.stage_resources:
            hit = resource_model.hit(_predictions(pred), outcome.stage_resources)
            trial.set_user_attr("spilled", resource_model.actual_spills(outcome.stage_resources))
            trial.set_user_attr("model_hit", hit)
        value: float | None = None
        if outcome.ok:
            value = outcome.time_ms if c.kind == "whole" else _estimate(c, outcome.stage_ms)
        if value is not None and math.isfinite(value):
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=TrialState.FAIL)
        self.open.pop(trial.number, None)
        ok = value is not None and math.isfinite(value)
        self.completed += int(ok)
        params = dict(trial.params)
        self.strategy.observe(Result(c, params, ok, value, dict(outcome.stage_ms), trial.number, outcome.reason))

    def poll_elsewhere(self, elsewhere: list[Elsewhere], trials: list[FrozenTrial]) -> None:
        """Hand the strategy the results other processes finished; run it here if theirs takes too long."""
        by_number = {t.number: t for t in trials}
        for e in list(elsewhere):
            t = by_number.get(e.number)
            if t is not None and t.state in _FINISHED:
                elsewhere.remove(e)
                known = self.known(e.candidate, trials)
                if known is not None:
                    self.strategy.observe(known)
                else:  # it never ran to its end there: run it here
                    assert e.candidate.params is not None
                    self.strategy.observe(Result(e.candidate, e.candidate.params, False, reason="interrupted"))
            elif time.monotonic() - e.since > 2 * self.cfg.trial_timeout:
                elsewhere.remove(e)
                assert e.candidate.params is not None
                self.strategy.observe(Result(e.candidate, e.candidate.params, False, reason="timeout"))

    def close_open(self, reason: str, message: str, on_trial: Callable[[], None] | None) -> None:
        """Close every trial of this process still open with ``reason`` (never leave one RUNNING)."""
        for number, item in list(self.open.items()):
            try:
                item.trial.set_user_attr("reason", reason)
                item.trial.set_user_attr("message", message)
                self.study.tell(item.trial, state=TrialState.FAIL, skip_if_finished=True)
            except Exception:  # closing as many as possible matters more
                logging.getLogger(__name__).exception("could not close trial %d", number)
            self.open.pop(number, None)
            if on_trial is not None:
                on_trial()

    def beat(self) -> None:
        """Heartbeats of this process's running trials (RDB storages), and the stale trials of dead processes."""
        now = time.monotonic()
        if now - self.last_beat < HEARTBEAT_S / 2:
            return
        self.last_beat = now
        record_heartbeats(self.study, [p.trial for p in self.open.values()])
        reap_stale(self.study)


def _kind(t: FrozenTrial) -> str:
    return str(t.user_attrs.get("kind", "whole"))


def _order(value: Any) -> tuple[int, Any]:
    """Choices sorted: numbers by value, others by their text (bools and strings keep a stable order)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def _estimate(c: Candidate, stage_ms: dict[str, float]) -> float | None:
    """A stage-local move's value: its base's whole time with the moved stage's time replaced."""
    base: Measured | None = c.base
    if base is None or c.stage is None or c.stage not in stage_ms or c.stage not in base.stage_ms:
        return None
    return base.value - base.stage_ms[c.stage] + stage_ms[c.stage]


def _predictions(raw: dict[str, Any]) -> dict[str, resource_model.StagePrediction]:
    return {n: resource_model.StagePrediction(float(v[0]), int(v[1]), int(v[2])) for n, v in raw.items()}


def record(trial: Trial, outcome: Any) -> None:
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

    def out_of_time() -> bool:
        return INTERRUPTED.is_set() or (cfg.timeout is not None and time.monotonic() - t0 >= cfg.timeout)

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
    # the search records its trials' heartbeats itself (ShapeSearch.beat), not through Study.optimize
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
            if INTERRUPTED.is_set():
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
