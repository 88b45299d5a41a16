"""Only COMPLETE trials that passed the gate can win (and so ever be exported)."""

from __future__ import annotations

from typing import Any

from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from dtune.tune import results


def trial(number: int, value: float | None, state: TrialState = TrialState.COMPLETE, **attrs: Any) -> FrozenTrial:
    t = create_trial(
        state=state,
        value=value,
        params={"BV": 16},
        distributions={"BV": CategoricalDistribution([8, 16])},
        user_attrs={"gate_passed": True, "reason": None, "time_ms": value, **attrs},
    )
    t.number = number
    return t


def test_best_requires_a_passed_gate() -> None:
    good = trial(0, 2.0, is_default=True)
    faster_but_failed_gate = trial(1, 1.0, gate_passed=False)
    faster_with_reason = trial(2, 1.0, reason="runtime")
    failed = trial(3, None, TrialState.FAIL, gate_passed=False, reason="crash")
    pruned = trial(4, None, TrialState.PRUNED, gate_passed=False, reason="constraint")
    trials = [good, faster_but_failed_gate, faster_with_reason, failed, pruned]
    assert results.best_trial(trials) is good
    assert results.best_trial([faster_but_failed_gate, failed, pruned]) is None
    assert results.default_trial(trials) is good
    assert results.counts(trials) == {"complete": 3, "failed": 1, "pruned": 1}
    assert results.failures_by_reason(trials) == {"constraint": 1, "crash": 1}


def test_rows_carry_default_time_and_params() -> None:
    meta = {
        "kernel": "k",
        "gpu": "cpu",
        "dtype": "fp32",
        "shape_key": "s",
        "B": 1,
        "T": 2,
        "H": 1,
        "HV": 1,
        "K": 16,
        "V": 16,
    }
    rows = results.trial_rows(
        "study", meta, [trial(0, 2.0, is_default=True, config={"BV": 16, "num_warps": 1}), trial(1, 1.0)]
    )
    frame = results.trials_frame(rows)
    assert list(frame.columns[: len(results.COLUMNS)]) == results.COLUMNS
    assert frame["default_time_ms"].tolist() == [2.0, 2.0]
    assert frame["p.num_warps"].tolist()[0] == 1 and frame["p.BV"].tolist() == [16, 16]


def test_a_stage_local_result_is_never_the_winner() -> None:
    """A stage-local move's value is an estimate (its stage timed alone): only whole trials may be exported."""
    whole = trial(0, 2.0, is_default=True, kind="whole")
    stage_only = trial(1, 1.5, kind="stage", stage="state")
    legacy = trial(2, 1.8)  # a study of an older dtune: no kind recorded, timed as a whole
    assert results.best_trial([whole, stage_only]) is whole
    assert results.best_trial([whole, stage_only, legacy]) is legacy
    assert not results.passed(stage_only) and results.passed(stage_only, allow_stage=True)


def test_a_failed_trial_without_reason_was_interrupted() -> None:
    stale = trial(0, None, TrialState.FAIL, gate_passed=None, reason=None)  # failed stale by a heartbeat reaper
    assert results.reason_of(stale) == "interrupted"
    assert results.failures_by_reason([stale]) == {"interrupted": 1}


def test_a_trial_without_a_passed_gate_never_wins() -> None:
    """No failure reason recorded is not a pass: a COMPLETE trial whose gate failed (or never ran: no gate attribute)
    and a trial whose process died are never the best, however fast they look."""
    good = trial(0, 2.0, is_default=True)
    failed_gate_no_reason = trial(1, 0.5, gate_passed=False, reason=None)
    never_gated = trial(2, 0.5, gate_passed=None, reason=None)
    stale = trial(3, None, TrialState.FAIL, gate_passed=None, reason=None)
    for t in (failed_gate_no_reason, never_gated, stale):
        assert not results.passed(t) and not results.passed(t, allow_stage=True)
    assert results.best_trial([good, failed_gate_no_reason, never_gated, stale]) is good
    assert results.best_trial([failed_gate_no_reason, never_gated, stale]) is None
