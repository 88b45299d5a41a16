"""Trials as data: one row per finished trial (``trials.csv``), the best passing trial of a study.

A trial's outcome lives in its Optuna user attributes (set by :mod:`dtune.tune.bookkeeping`); this module is the one
place that turns them into rows, so the CSV's columns and the export's choice of winner agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from dtune.shape import SHAPE_COLUMNS

STATES = {TrialState.COMPLETE: "complete", TrialState.FAIL: "failed", TrialState.PRUNED: "pruned"}

MEASURED = ["time_ms", "error_o", "error_s", "registers", "spills", "shared_mem", "gbs", "tflops", "peak_mb"]
# What a trial's outcome leaves on it (user attributes; bookkeeping.record): the CSV and the export read them.
OUTCOME_ATTRS = ("reason", "message", "meaningful", "compile_s", *MEASURED, "stage_ms", "stage_resources", "built")
# The search's own columns after the measured ones: how the trial came about and what it cost.
SEARCH_COLUMNS = [
    "kind",  # whole | stage (a stage-local move: timed on one stage, its value an estimate; never exported)
    "stage",
    "value_ms",  # the study's value: time_ms for whole trials, the estimate for stage-local ones
    "source",  # default, seed, transfer:..., retry, resume, stage, combine, coupling, sampler
    "built_ahead",  # kernels the compile pool built for it
    "built",  # kernels the timing worker built itself (0 when the pool did its job)
    "device",
    "pred_spill",  # stages the resource model predicted to spill
    "spilled",  # stages that did spill (ptxas)
    "model_hit",
]

COLUMNS = [
    "study",
    "kernel",
    "gpu",
    "dtype",
    "shape_key",
    *SHAPE_COLUMNS,
    "number",
    "state",
    "reason",
    "message",
    "time_ms",
    "default_time_ms",
    *MEASURED[1:],
    "is_default",
    "datetime_start",
    "duration_s",
    *SEARCH_COLUMNS,
]


def is_whole(trial: FrozenTrial) -> bool:
    """Whether the trial gated (edge case included) and timed its config as a whole (not a stage-local move)."""
    return trial.user_attrs.get("kind", "whole") == "whole"


def passed(trial: FrozenTrial, allow_stage: bool = False) -> bool:
    """A COMPLETE trial whose config passed the gate and was timed as a whole: the only kind that may ever be
    exported (a stage-local move's value is an estimate; ``allow_stage`` accepts those too, for the search)."""
    return (
        trial.state == TrialState.COMPLETE
        and trial.user_attrs.get("gate_passed") is True
        and trial.user_attrs.get("reason") is None
        and trial.value is not None
        and math.isfinite(trial.value)
        and (allow_stage or is_whole(trial))
    )


def reason_of(trial: FrozenTrial) -> str | None:
    """The failure reason; a FAIL without one is a trial whose process died (failed stale by a heartbeat reaper)."""
    reason = trial.user_attrs.get("reason")
    if reason is None and trial.state == TrialState.FAIL:
        return "interrupted"
    return reason


def best_trial(trials: Iterable[FrozenTrial]) -> FrozenTrial | None:
    """The fastest passing trial, or None."""
    good = [t for t in trials if passed(t)]
    return min(good, key=lambda t: (t.value, t.number)) if good else None


def default_trial(trials: Iterable[FrozenTrial]) -> FrozenTrial | None:
    """The study's baseline: the first trial of the template's default config."""
    defaults = [t for t in trials if t.user_attrs.get("is_default") and t.state in STATES]
    return min(defaults, key=lambda t: t.number) if defaults else None


def counts(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    out = {"complete": 0, "failed": 0, "pruned": 0}
    for t in trials:
        if t.state in STATES:
            out[STATES[t.state]] += 1
    return out


def failures_by_reason(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trials:
        reason = reason_of(t)
        if t.state in (TrialState.FAIL, TrialState.PRUNED) and reason:
            out[reason] = out.get(reason, 0) + 1
    return dict(sorted(out.items()))


def model_hits(trials: Iterable[FrozenTrial]) -> tuple[int, int]:
    """(hits, checked): compiled trials whose resource-model spill prediction matched ptxas, of those checked."""
    checked = [t.user_attrs.get("model_hit") for t in trials if t.user_attrs.get("model_hit") is not None]
    return sum(bool(h) for h in checked), len(checked)


def trial_rows(study: str, meta: dict[str, Any], trials: Sequence[FrozenTrial]) -> list[dict[str, Any]]:
    """One row per finished trial; ``meta`` holds kernel, gpu, dtype, shape_key, B, T, H, HV, K, V."""
    base = default_trial(trials)
    default_ms = base.user_attrs.get("time_ms") if base is not None and passed(base) else None
    rows = []
    for t in trials:
        if t.state not in STATES:
            continue
        a = t.user_attrs
        duration = t.duration.total_seconds() if t.duration is not None else None
        row: dict[str, Any] = {"study": study, **{k: meta.get(k) for k in COLUMNS[1:11]}}
        reason = reason_of(t)
        row.update(
            number=t.number,
            state=STATES[t.state],
            reason=reason,
            message=a.get("message", "") or ("its process stopped (no heartbeat)" if reason == "interrupted" else ""),
            default_time_ms=default_ms,
            is_default=bool(a.get("is_default", False)),
            datetime_start=t.datetime_start.isoformat() if t.datetime_start else None,
            duration_s=duration,
            kind=a.get("kind", "whole"),
            stage=a.get("stage"),
            value_ms=t.value if t.state == TrialState.COMPLETE else None,
            source=a.get("source"),
            built_ahead=a.get("built_ahead"),
            built=a.get("built"),
            device=a.get("device"),
            pred_spill=" ".join(a.get("pred_spill") or []) if "pred_spill" in a else None,
            spilled=" ".join(a["spilled"]) if isinstance(a.get("spilled"), list) else None,
            model_hit=a.get("model_hit"),
        )
        for key in MEASURED:
            row[key] = a.get(key)
        for name, ms in (a.get("stage_ms") or {}).items():
            row[f"ms.{name}"] = ms
        for name, value in (a.get("config") or t.params).items():
            row[f"p.{name}"] = value
        rows.append(row)
    return rows


def trials_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    stages = sorted({k for r in rows for k in r if k.startswith("ms.")})
    params = sorted({k for r in rows for k in r if k.startswith("p.")})
    return pd.DataFrame(rows, columns=[*COLUMNS, *stages, *params])


def write_trials_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rewrite the CSV atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".csv.tmp")
    trials_frame(rows).to_csv(tmp, index=False)
    tmp.replace(path)
