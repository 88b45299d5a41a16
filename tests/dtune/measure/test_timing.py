"""The one timing function's summary and mode (the CUDA paths run in the GPU tests)."""

from __future__ import annotations

import pytest

from dtune.measure.timing import GRAPH_MAX_T, _summary, time_fn, timing_mode


def test_summary_is_the_median_with_its_spread() -> None:
    t = _summary([5.0, 1.0, 3.0, 100.0, 2.0], meaningful=True)
    assert (t.median_ms, t.min_ms, t.repeats) == (3.0, 1.0, 5)  # one outlier moves neither
    assert t.iqr_ms > 0


def test_auto_timing_replays_graphs_up_to_the_short_sequences() -> None:
    assert timing_mode("auto", GRAPH_MAX_T) == "graph" and timing_mode("auto", GRAPH_MAX_T + 1) == "events"
    assert timing_mode("events", 1) == "events" and timing_mode("graph", 4096) == "graph"
    with pytest.raises(ValueError, match="unknown timing"):
        timing_mode("cupti", 1)


def test_cpu_times_are_host_clock_and_marked() -> None:
    t = time_fn(lambda: sum(range(100)), "cpu", warmup=1, repeats=3)
    assert t.repeats == 3 and t.median_ms >= 0 and not t.meaningful
