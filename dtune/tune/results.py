"""Trials as data: one row per finished trial (``trials.csv``), the best passing trial of a study.

A trial's outcome lives in its Optuna user attributes (set by :mod:`dtune.search`); this module is the one
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

MEASURED = ["time_ms", "error_o", "error_s", "registers", "spills", "shared_mem", "gbs", "tflops"]
# What a trial's outcome leaves on it (user attributes; dtune.tune.search.record): the CSV and the export read them.
OUTCOME_ATTRS = ("reason", "message", "meaningful", "compile_s", *MEASURED)

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
]


def passed(trial: FrozenTrial) -> bool:
    """A COMPLETE trial whose config passed the gate: the only kind that may ever be exported."""
    return (
        trial.state == TrialState.COMPLETE
        and trial.user_attrs.get("gate_passed") is True
        and trial.user_attrs.get("reason") is None
        and trial.value is not None
        and math.isfinite(trial.value)
    )


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
        reason = t.user_attrs.get("reason")
        if t.state in (TrialState.FAIL, TrialState.PRUNED) and reason:
            out[reason] = out.get(reason, 0) + 1
    return dict(sorted(out.items()))


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
        row.update(
            number=t.number,
            state=STATES[t.state],
            reason=a.get("reason"),
            message=a.get("message", ""),
            default_time_ms=default_ms,
            is_default=bool(a.get("is_default", False)),
            datetime_start=t.datetime_start.isoformat() if t.datetime_start else None,
            duration_s=duration,
        )
        for key in MEASURED:
            row[key] = a.get(key)
        for name, value in (a.get("config") or t.params).items():
            row[f"p.{name}"] = value
        rows.append(row)
    return rows


def trials_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    params = sorted({k for r in rows for k in r if k.startswith("p.")})
    return pd.DataFrame(rows, columns=[*COLUMNS, *params])


def write_trials_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rewrite the CSV atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".csv.tmp")
    trials_frame(rows).to_csv(tmp, index=False)
    tmp.replace(path)
