"""The study of one shape and its run loop: the strategy proposes, the loop checks, submits, and tells, until the
budget is spent.

Each proposed config is answered from the study when it already holds a result (:meth:`TrialBook.known`), awaited when
another process runs it (:mod:`dtune.tune.peers`), or becomes a trial (:mod:`dtune.tune.bookkeeping`): pruned when it
breaks a constraint or the resource model predicts heavy spills or a shared-memory overflow (never the default, which
every speedup is measured against), else submitted to the executor, which compiles, gates and times it in a worker
(:mod:`dtune.tune.executor`). Once the time budget runs out the trials in flight are closed as ``cancelled``; on any
exception (Ctrl-C) as ``interrupted``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import optuna
from dtune.kernels import get_kernel
from optuna.exceptions import DuplicatedStudyError
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

from dtune.measure.timing import timing_mode
from dtune.shape import Shape
from dtune.tune import resource_model, results
from dtune.tune.bookkeeping import Pending, TrialBook, params_key
from dtune.tune.executor import Evaluated, Evaluator
from dtune.tune.pattern import PatternSearch
from dtune.tune.peers import Peers
from dtune.tune.search_config import SearchConfig
from dtune.tune.starts import starting_configs
from dtune.tune.storage import reap_stale, study_name
from dtune.tune.strategy import Candidate, Result, SamplerStrategy, Strategy, make_sampler
from dtune.tune.trials import TrialJob

__all__ = ["POLL_S", "ShapeSearch"]

POLL_S = 0.5  # the loop's wake-up: budgets, heartbeats, trials other processes run


def _order(value: Any) -> tuple[int, Any]:
    """Choices sorted: numbers by value, others by their text (bools and strings keep a stable order)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


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
        created = self._open_study(storage)
        self.book = TrialBook(self.study, self.choices, cfg.kernel, shape, cfg.dtype)
        self.peers = Peers(self.book, cfg.trial_timeout)
        starts = starting_configs(cfg, shape, self.baseline, self.choices, self.book.trials() if cfg.resume else [])
        # a transferred config the constraints rule out at this shape costs no trial (nor a --trials slot)
        starts = [c for c in starts if not c.source.startswith("transfer") or c.params is None or self.legal(c.params)]
        # the transferred configs and the default: a shape's budget is not spent before they are answered
        self.must_answer = {
            params_key({**self.baseline, **c.params})
            for c in starts
            if c.params is not None and (c.is_default or c.source.startswith("transfer"))
        }
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

    def _open_study(self, storage: BaseStorage) -> bool:
        """Create or load the study (an existing one only with --resume); True when this process created it."""
        cfg = self.cfg
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
        sampler = make_sampler(cfg.strategy, cfg.seed, self.choices, parallel=self.evaluator.capacity > 1)
        self.study = optuna.load_study(study_name=self.name, storage=storage, sampler=sampler)
        reap_stale(self.study)
        if created:
            for key, value in self.meta().items():
                self.study.set_user_attr(key, value)
            self.study.set_user_attr("default_config", self.default)
        return created

    # ---- what the driver reads -----------------------------------------------------------------------------
    @property
    def asked(self) -> int:
        """Trials this process created (the --trials budget)."""
        return self.book.asked

    @property
    def evaluated(self) -> int:
        """Trials of this process a worker answered."""
        return self.book.evaluated

    @property
    def completed(self) -> int:
        """Trials this process gated and timed."""
        return self.book.completed

    def meta(self) -> dict[str, Any]:
        return {"kernel": self.cfg.kernel, "gpu": self.cfg.gpu.key, "dtype": self.cfg.dtype, **self.shape.as_dict()}

    def finished(self) -> list[FrozenTrial]:
        return self.book.finished()

    def rows(self) -> list[dict[str, Any]]:
        return results.trial_rows(self.name, self.meta(), self.book.trials())

    # ---- a config's checks and job -------------------------------------------------------------------------
    def legal(self, params: dict[str, Any]) -> bool:
        return not self.cfg.space.violations({**self.default, **params}, self.shape, self.gpu_fields)

    def exhausted(self, finished: list[FrozenTrial]) -> bool:
        return len({params_key(t.params) for t in finished}) >= self.size

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

    def job(self, number: int, config: dict[str, Any], c: Candidate) -> TrialJob:
        cfg, s = self.cfg, self.shape
        stage = c.kind == "stage"
        return TrialJob(
            kernel=cfg.kernel,
            shape=s.bucket(),
            dtype=cfg.dtype,
            config=config,
            tolerance=cfg.space.tolerance[cfg.dtype],
            max_vs_default=cfg.space.accuracy.get(cfg.dtype),
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
        waiting = self.peers.waiting
        capacity = self.evaluator.capacity
        done = False
        try:
            while True:
                self.peers.beat()
                if out_of_time():
                    self.book.close_open("cancelled", "the time budget ran out before this trial finished", on_trial)
                    self.evaluator.abort()
                    return
                trials = self.book.trials()
                for r in self.peers.poll(trials):
                    self.strategy.observe(r)
                progressed = False
                while not done and len(in_flight) + len(waiting) < capacity and not self.stopping(should_stop):
                    cands = self.strategy.propose(capacity - len(in_flight) - len(waiting))
                    if cands is None:
                        done = True
                        break
                    if not cands:
                        break
                    progressed = True
                    for c in cands:
                        if self.stopping(should_stop):
                            break
                        if self.start(c, trials, in_flight, on_trial):
                            self.answered(c)  # known, run by another process, pruned or a duplicate: no wait
                        if c.params is None or self.book.open:
                            trials = self.book.trials()
                if not in_flight and not waiting:
                    if done or self.stopping(should_stop) or not progressed:
                        return
                    continue
                if not in_flight:
                    time.sleep(POLL_S)
                    continue
                finished, _ = wait(list(in_flight), timeout=POLL_S, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item = in_flight.pop(fut)
                    r = self.book.finish(item, fut.result())
                    if r.reason != "cancelled":
                        self.answered(item.candidate)
                    self.strategy.observe(r)
                    on_trial()
        except BaseException:
            self.book.close_open("interrupted", "interrupted before the trial finished", on_trial=None)
            self.evaluator.abort()
            raise

    def stopping(self, should_stop: Callable[[], bool]) -> bool:
        return should_stop() or self.exhausted(self.finished())

    def answered(self, c: Candidate) -> None:
        if c.params is not None:
            self.must_answer.discard(params_key({**self.baseline, **c.params}))

    def start(
        self,
        c: Candidate,
        trials: list[FrozenTrial],
        in_flight: dict[Future[Evaluated], Pending],
        on_trial: Callable[[], None],
    ) -> bool:
        """Create the trial of ``c`` (or answer it from the study), check it, and submit it; True when ``c`` was
        answered without an evaluation of this process."""
        if c.params is not None:
            known = self.book.known(c, trials)
            if known is not None:
                self.strategy.observe(known)
                return True
            other = self.peers.running(c, trials)
            if other is not None:
                self.peers.await_result(c, other)
                return True
        item = self.book.open_trial(c)
        trial = item.trial
        if c.params is not None:
            first = self.peers.claimed_first(trial, c)
            if first is not None:  # another process created the same trial just before: it runs it, this one waits
                self.book.prune(item, "claimed", f"trial {first} of another process runs this config", kind=c.kind)
                self.peers.await_result(c, first)
                on_trial()
                return True
        params = {n: trial.suggest_categorical(n, list(ch)) for n, ch in self.choices.items()}
        if c.params is None:  # a sampler's pick (or a config the creator enqueued)
            attrs = trial.user_attrs
            c = Candidate(params, source=str(attrs.get("source", "sampler")), is_default=bool(attrs.get("is_default")))
            item.candidate = c
        config = {**self.default, **params}
        self.book.annotate(item, config)
        if c.kind == "whole" and c.source == "sampler":
            dup = self.book.earlier_duplicate(trial, params)
            if dup is not None and not c.is_default:
                self.strategy.observe(self.book.tell_duplicate(item, dup))
                on_trial()
                return True
        reason, message = self.rejected(c, config)
        if reason is not None:
            self.book.prune(item, reason, message, gate_passed=False)
            self.strategy.observe(Result(c, params, False, number=trial.number, reason=reason))
            on_trial()
            return True
        item.future = self.evaluator.submit(self.job(trial.number, config, c))
        in_flight[item.future] = item
        return False
