"""Assemble the report's sections from a run folder and write the page."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from . import charts
from . import data as d
from .html import Section, page

MIN_COMPLETE_FOR_IMPORTANCE = 5
MAX_TABLE_ROWS = 5000
FLA = "fla's fastest mode (bench.csv)"


def default_output(run_dir: str | Path, reports_dir: str | Path = "reports") -> Path:
    """``reports/<run-name>.html``."""
    return Path(reports_dir) / f"{Path(run_dir).resolve().name}.html"


def _summary(data: d.RunData) -> Section:
    s = Section("summary", "Summary")
    env = d.environment(data.run)
    if env:
        s.add_definitions(env)
    else:
        s.add_note("run.json is missing: environment unknown")
    best = d.speedups(data)
    tuned = d.tuned_frame(data.tuned)
    table = tuned if tuned is not None else best
    if table is not None:
        s.add_note("Best configuration per shape" + (" (tuned.json)" if tuned is not None else " (trials.csv)") + ":")
        cols = [
            c
            for c in (
                "kernel",
                "dtype",
                *d.SHAPE_COLS,
                "best_ms",
                "default_ms",
                "speedup",
                "gate_error",
                "error_o",
                "complete",
                "failed",
                "pruned",
                "config",
            )
            if c in table.columns
        ]
        shown = table[cols].copy()
        shown["config"] = shown["config"].map(d.compact_config)
        s.add_table(shown, sortable=True)
    elif not env:
        s.missing = "no run.json, tuned.json or trials.csv in this folder"
    for problem in data.problems:
        s.add_note(f"could not read {problem}")
    return s


def _chart_section(key: str, title: str, make: Callable[[Section], None]) -> Section:
    s = Section(key, title)
    try:
        make(s)
    except Exception as exc:  # one broken chart must not take the report down
        s.missing = f"could not draw this section: {type(exc).__name__}: {exc}"
    return s


def build_sections(data: d.RunData) -> list[Section]:
    """Every section of the report, each with its chart/table or a note saying what is missing."""
    sp = d.speedups(data)

    fla = d.fla_speedups(data.bench)
    no_speedups = "no complete trials with a default time (trials.csv or tuned.json): no speedups to plot"
    no_fla = "No speedup against flash-linear-attention: bench.csv has no fla rows (fla not installed or not run)."

    def speedup_section(prepare: Callable, draw: Callable) -> Callable[[Section], None]:
        """Speedup against the default and against fla along one axis (sequence length or head dim)."""

        def make(s: Section) -> None:
            if sp is not None:
                s.add_figure(draw(prepare(sp)))
            if fla is not None:
                s.add_figure(draw(prepare(fla), FLA))
            elif sp is not None:
                s.add_note(no_fla)
            if sp is None:
                s.missing = no_speedups

        return make

    speed_T = speedup_section(d.speedup_vs_seq_len, charts.speedup_vs_seq_len)
    speed_D = speedup_section(d.speedup_vs_head_dim, charts.speedup_vs_head_dim)

    def bench(s: Section) -> None:
        if data.bench is None:
            s.missing = "no bench.csv in the run folder: run `dtune bench --config RUN/tuned.json` to add one"
            return
        frame = d.bench_times(data.bench)
        s.add_figure(charts.bench_times(frame))
        if not frame["meaningful"].all():
            s.add_note("Some times come from Triton's interpreter on the CPU: they are NOT meaningful.")
        s.add_table(frame.drop(columns=["T", "K"]), sortable=True)

    def stages(s: Section) -> None:
        if data.profile is None:
            s.missing = "no profile.csv in the run folder: run `dtune profile --config RUN/tuned.json --out RUN`"
            return
        frame = d.stage_breakdown(data.profile)
        s.add_figure(charts.stage_breakdown(frame))
        s.add_table(frame, sortable=True)

    def roof(s: Section) -> None:
        points = d.roofline_points(data.bench, data.profile)
        roofs = d.roofs(data)
        if points is None:
            s.missing = "no bench.csv or profile.csv with achieved TFLOP/s: nothing to place on the roofline"
            return
        s.add_figure(charts.roofline(points, roofs))
        if not roofs:
            s.add_note(
                "No roofs drawn: run.json has no GPU profile with bandwidth and matmul rate, and no ceilings "
                "were measured (`dtune profile` on a GPU measures them)."
            )
        s.add_note(
            "FLOPs are nominal (chunk: 2C(3K+2V)+6KV per token per head, C = 64) and bytes compulsory "
            "(q, k, v, o, beta, g and any state), as in docs/anchors/fla-0.6.0_h200.md."
        )

    def history(s: Section) -> None:
        if data.trials is None:
            s.missing = "no trials.csv in the run folder"
            return
        frame = d.search_history(data.trials)
        if frame.empty:
            s.missing = "no complete trials yet"
            return
        s.add_figure(charts.search_history(frame))

    def importance(s: Section) -> None:
        frame, notes = d.param_importance(data.study_db, MIN_COMPLETE_FOR_IMPORTANCE)
        if not frame.empty:
            s.add_figure(charts.param_importance(frame))
        for n in notes:
            s.add_note(n)
        if frame.empty:
            s.missing = "not enough trials for parameter importance" + ("" if notes else " (no studies)")

    def fails(s: Section) -> None:
        if data.trials is None:
            s.missing = "no trials.csv in the run folder"
            return
        frame = d.failures_by_reason(data.trials)
        if frame.empty:
            s.add_note("No trial failed or was pruned.")
            return
        s.add_figure(charts.failures(frame))
        s.add_table(frame)

    def trials(s: Section) -> None:
        if data.trials is None:
            s.missing = "no trials.csv in the run folder"
            return
        frame = d.trial_table(data.trials)
        if len(frame) > MAX_TABLE_ROWS:
            s.add_note(f"{len(frame)} trials: showing the first {MAX_TABLE_ROWS}; trials.csv has them all.")
            frame = frame.head(MAX_TABLE_ROWS)
        s.add_note("Click a column header to sort.")
        s.add_table(frame, sortable=True)

    return [
        _summary(data),
        _chart_section("speedup-T", "Speedup vs sequence length", speed_T),
        _chart_section("speedup-D", "Speedup vs head dim", speed_D),
        _chart_section("baselines", "Time against each baseline", bench),
        _chart_section("stages", "Per-stage breakdown", stages),
        _chart_section("roofline", "Roofline", roof),
        _chart_section("history", "Search history", history),
        _chart_section("importance", "Parameter importance", importance),
        _chart_section("failures", "Failures by reason", fails),
        _chart_section("trials", "All trials", trials),
    ]


def build_report(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, dict[str, str]]:
    """Write the report of ``run_dir`` (default: reports/<run-name>.html); return its path and each section's state."""
    data = d.load_run(run_dir)
    sections = build_sections(data)
    out = Path(output) if output is not None else default_output(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    kernel = data.run.get("kernel", "")
    gpu = (data.run.get("gpu") or {}).get("name", "")
    title = f"dtune report: {data.name}"
    subtitle = " · ".join(
        x for x in (str(kernel), str(gpu), f"generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC") if x
    )
    out.write_text(page(title, subtitle, sections), encoding="utf-8")
    return out, {s.key: s.state for s in sections}
