"""A study's trials as one search process keeps them: created, annotated, told, answered from earlier results.

:class:`TrialBook` owns this process's open trials (created and not yet told) and every ``tell``: a trial is created
RUNNING with its config's parameters (or asked from the study for a sampler's pick), carries its config, source and
resource prediction as user attributes, and is told exactly once: COMPLETE with its time, FAIL (gate, compile, crash,
``cancelled`` / ``interrupted`` when the search stopped first), or PRUNED (a constraint, the resource model, another
process's claim). A trial that never ran to its end (:func:`retryable`) answers nothing: its config stays open and is
retried on ``--resume``. Each method returns the :class:`~dtune.tune.strategy.Result` the strategy is to observe.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, Trial, TrialState

from dtune.shape import Shape
from dtune.tune import resource_model, results
from dtune.tune.executor import Evaluated
from dtune.tune.interrupt import sigint_deferred
from dtune.tune.storage import record_heartbeats
from dtune.tune.strategy import Candidate, Measured, Result
from dtune.tune.trials import RETRYABLE

__all__ = ["FINISHED", "Pending", "TrialBook", "kind_of", "params_key", "record", "retryable"]

FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def params_key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A config's parameters as a hashable key (the same config, whatever the order of its keys)."""
    return tuple(sorted(params.items()))


def retryable(t: FrozenTrial) -> bool:
    """A trial that never ran to its end (cancelled, interrupted, or failed stale because its process died)."""
    reason = t.user_attrs.get("reason")
    return reason in RETRYABLE or (t.state == TrialState.FAIL and reason is None)


def kind_of(t: FrozenTrial) -> str:
    """``whole`` or ``stage`` (a stage-local move); trials of older studies are whole."""
    return str(t.user_attrs.get("kind", "whole"))


def record(trial: Trial, outcome: Any) -> None:
    """Keep the outcome on the trial (the CSV and the export read these attributes)."""
    for key in results.OUTCOME_ATTRS:
        trial.set_user_attr(key, getattr(outcome, key))
    trial.set_user_attr("gate_passed", outcome.ok)


def estimate(c: Candidate, stage_ms: dict[str, float]) -> float | None:
    """A stage-local move's value: its base's whole time with the moved stage's time replaced."""
    base: Measured | None = c.base
    if base is None or c.stage is None or c.stage not in stage_ms or c.stage not in base.stage_ms:
        return None
    return base.value - base.stage_ms[c.stage] + stage_ms[c.stage]


def _predictions(raw: dict[str, Any]) -> dict[str, resource_model.StagePrediction]:
    return {n: resource_model.StagePrediction(float(v[0]), int(v[1]), int(v[2])) for n, v in raw.items()}


@dataclass
class Pending:
    """A trial created and not yet told: its candidate, full config and the evaluation in flight."""

    trial: Trial
    candidate: Candidate
    config: dict[str, Any] = field(default_factory=dict)
    future: Future[Evaluated] | None = None


class TrialBook:
    """This process's trials of one study: which are open, how many it created and completed, and every tell."""

    def __init__(
        self, study: optuna.Study, choices: dict[str, tuple[Any, ...]], kernel: str, shape: Shape, dtype: str
    ) -> None:
        self.study, self.choices = study, choices
        self.kernel, self.shape, self.dtype = kernel, shape, dtype
        self.open: dict[int, Pending] = {}  # this process's trials not yet told
        self.asked = 0  # trials this process created (the --trials budget)
        self.completed = 0  # trials this process gated and timed (the throughput figure)
        self.evaluated = 0  # trials a worker answered (passed, failed the gate or crashed), not closed unanswered

    # ---- what the study holds ------------------------------------------------------------------------------
    def trials(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False)

    def finished(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=FINISHED)

    def known(self, c: Candidate, trials: list[FrozenTrial]) -> Result | None:
        """A finished trial of the same config that answers ``c`` (none that never ran to its end)."""
        assert c.params is not None
        k = params_key(c.params)
        for t in trials:
            if t.state not in FINISHED or params_key(t.params) != k or retryable(t):
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

    def earlier_duplicate(self, trial: Trial, params: dict[str, Any]) -> FrozenTrial | None:
        """A finished trial of another number with these parameters whose result a sampler's repeat may copy."""
        earlier = {
            params_key(t.params): t
            for t in self.finished()
            if not retryable(t) and t.number != trial.number and t.user_attrs.get("reason") != "claimed"
        }
        return earlier.get(params_key(params))

    @staticmethod
    def result_of(c: Candidate, t: FrozenTrial, reused: bool = False) -> Result:
        ok = t.state == TrialState.COMPLETE and results.passed(t, allow_stage=True)
        stage_ms = dict(t.user_attrs.get("stage_ms") or {})
        value = t.value if ok else None
        if ok and c.kind == "stage":
            value = estimate(c, stage_ms)
        elif ok and c.kind == "whole" and not results.is_whole(t):
            ok, value = False, None
        return Result(c, dict(t.params), ok, value, stage_ms, t.number, t.user_attrs.get("reason"), reused)

    # ---- creating ------------------------------------------------------------------------------------------
    def open_trial(self, c: Candidate) -> Pending:
        """A new RUNNING trial for ``c``, tracked as open (a sampler's pick is asked from the study)."""
        with sigint_deferred():  # the trial exists in storage only once it is tracked in self.open
            trial = self.study.ask() if c.params is None else self.create_trial(c.params)
            item = Pending(trial, c)
            self.open[trial.number] = item
        record_heartbeats(self.study, [trial])  # from its first moment: a process killed now leaves a stale trial
        self.asked += 1
        return item

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

    def annotate(self, item: Pending, config: dict[str, Any]) -> None:
        """Keep the trial's full config, how it came about and the resource model's prediction on it."""
        c = item.candidate
        item.config = config
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
        pred = resource_model.predict(self.kernel, config, self.shape.K, self.shape.V, self.dtype)
        if pred is not None:
            attrs["predicted"] = {n: [round(p.registers), p.shared, p.cap] for n, p in pred.items()}
            attrs["pred_spill"] = resource_model.predicted_spills(pred)
        for key, value in attrs.items():
            item.trial.set_user_attr(key, value)

    # ---- telling -------------------------------------------------------------------------------------------
    def prune(self, item: Pending, reason: str, message: str, **attrs: Any) -> None:
        """Tell the trial PRUNED with ``reason`` (nothing was compiled or run)."""
        trial = item.trial
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("message", message)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        self.study.tell(trial, state=TrialState.PRUNED)
        del self.open[trial.number]

    def tell_duplicate(self, item: Pending, earlier: FrozenTrial) -> Result:
        """Tell the trial the result of an earlier trial of the same config (a sampler's repeat is not re-run)."""
        trial = item.trial
        for key, value in earlier.user_attrs.items():
            if key not in ("is_default", "config", "source"):
                trial.set_user_attr(key, value)
        trial.set_user_attr("duplicate_of", earlier.number)
        value = earlier.value if earlier.state == TrialState.COMPLETE else None
        self.study.tell(trial, value, state=earlier.state)
        del self.open[trial.number]
        return self.result_of(item.candidate, earlier, reused=True)

    def finish(self, item: Pending, ev: Evaluated) -> Result:
        """Record the evaluation on the trial and tell the study: COMPLETE with its value, or FAIL. A trial that another
        process sharing the study has already failed as stale (this process sent no heartbeat for the grace period:
        a long compile on a loaded host) keeps that verdict: its result is not recorded, the config is retried on
        ``--resume`` as an interrupted one, and this search goes on."""
        try:
            return self._finish(item, ev)
        except optuna.exceptions.UpdateFinishedTrialError:
            self.open.pop(item.trial.number, None)
            self.evaluated += 1
            logging.getLogger(__name__).warning(
                "trial %d was failed as stale by another process sharing the study; its result is not recorded",
                item.trial.number,
            )
            return Result(item.candidate, dict(item.trial.params), False, reason="interrupted")

    def _finish(self, item: Pending, ev: Evaluated) -> Result:
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
            value = outcome.time_ms if c.kind == "whole" else estimate(c, outcome.stage_ms)
        if value is not None and math.isfinite(value):
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=TrialState.FAIL)
        self.open.pop(trial.number, None)
        ok = value is not None and math.isfinite(value)
        self.completed += int(ok)
        self.evaluated += 1
        return Result(c, dict(trial.params), ok, value, dict(outcome.stage_ms), trial.number, outcome.reason)

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
