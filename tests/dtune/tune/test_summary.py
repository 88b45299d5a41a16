"""What a search reports: the speedup is the default's time over the best's (above 1 when tuning paid)."""

from __future__ import annotations

from dtune.tune.summary import RunSummary, ShapeSummary


def test_speedup_is_default_over_best() -> None:
    s = ShapeSummary("study", "T4-B2-H2-HV2-K32-V32", best_ms=0.5, default_ms=2.0)
    assert s.speedup == 4.0 and s.as_dict()["speedup"] == 4.0
    assert ShapeSummary("study", "key", best_ms=0.5).speedup is None  # the default did not pass: no baseline
    assert ShapeSummary("study", "key", default_ms=2.0).speedup is None
    run = RunSummary("out", "sqlite:///out/study.db", "chunk_kda", "cpu", "fp32", True, shapes=[s])
    assert run.as_dict()["shapes"][0]["speedup"] == 4.0
