"""Assemble the report's sections from run folders and write the page.

The page opens with the answer for the three uses (:data:`dtune.report.data.USES`): prefill (the chunk forward),
the training step and decode, each with its own headline ratio against flash-linear-attention's fastest mode and
its own heatmap (prefill: op × head dim by sequence length, packed batches in columns of their own; decode: by batch;
training: by shape; a shape whose bucket was not tuned marked †). Then speedup along sequence length and head dim
(real sweeps only), each stage against its floor, the time of every implementation, the roofline, the search, every
trial, and the environment with one commit per source. A section without data is left out of the page; the last
section lists what was left out and why. Folders with nothing to report are an error (:class:`NothingToReport`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from pathlib import Path

from dtune.errors import FileProblem

from . import charts
from . import data as d
from .html import Section, page


class NothingToReport(FileProblem):
    """Folders that hold no run.json, trials.csv, bench.csv, profile.csv or tuned.json that could be read (the message
    names the folders and what could not be read)."""


MIN_COMPLETE_FOR_IMPORTANCE = 5
MAX_TABLE_ROWS = 5000
NOT_MEANINGFUL = "Timed under Triton's interpreter on the CPU: these times are NOT meaningful (they test the plumbing)."
SWEEP = (
    "needs bench rows at two or more {what} per kernel (a sweep: `dtune bench -k KERNEL --config FILE {flag} ...`); "
    "this data has one {one} per kernel"
)


def default_output(run_dir: str | Path, reports_dir: str | Path = "reports") -> Path:
    """``reports/<run-name>.html``."""
    return Path(reports_dir) / f"{Path(run_dir).resolve().name}.html"


def _guarded(key: str, title: str, make: Callable[[Section], None]) -> Section:
    s = Section(key, title)
    try:
        make(s)
    except Exception as exc:  # one broken chart must not take the report down
        s.parts.clear()
        s.missing = f"could not draw this section: {type(exc).__name__}: {exc}"
    return s


def build_sections(data: d.RunData) -> list[Section]:
    """Every section of the report, each with its charts and tables or the reason it has none (``missing``)."""
    vs, against = d.versus(data.bench)
    bench_ok = d.meaningful(data.bench)

    def answer(s: Section) -> None:
        if vs is None:
            s.missing = "no bench.csv with tuned and fla (or default) rows: run `dtune bench --config tuned.json`"
            return
        s.title = "dtune vs flash-linear-attention" if against == "fla" else "Tuned config vs the untuned default"
        grid = d.heatmap_rows(vs)
        present = [u for u in d.USES if (grid["use"] == u).any()]
        for use in present:
            s.add_headline(d.headline(grid[grid["use"] == use], against, use))
        for use in d.USES:
            if use not in present:
                s.add_note(f"{d.USE_TITLES[use]}: {d.USE_MISSING[use]}.")
        if not d.meaningful(vs):
            s.add_warning(NOT_MEANINGFUL)
        if against != "fla":
            s.add_note("bench.csv has no fla rows (fla not installed, or run on the CPU): compared with the default.")
        other = "fla" if against == "fla" else "default"
        for use in present:
            title = f"{d.USE_TITLES[use]}: time ratio, {other} / dtune"
            s.add_figure(charts.versus_heatmap(grid[grid["use"] == use], against, title))
        s.add_note(
            f"Each cell: {other}'s median time / dtune's (above 1×: dtune faster), dtune's median ms, then {other}'s. "
            + (
                "fla's fastest mode per shape: its default or, for chunk_kda, safe_gate=True. "
                if against == "fla"
                else ""
            )
            + (
                f"{d.UNTUNED}: the shape's bucket was not tuned; dtune ran a config borrowed from the nearest tuned "
                "buckets and adjusted to the shape (or the default): bench.csv's config_source says from where."
                if grid["untuned"].any()
                else ""
            )
        )
        s.add_table(d.versus_table(vs, against), sortable=True)

    def sweep(axis: str) -> Callable[[Section], None]:
        def make(s: Section) -> None:
            for who in ("fla", "default"):
                lines = d.speedup_lines(data.bench, axis, who)
                if len(lines):
                    s.add_figure(charts.speedup_lines(lines, axis, who))
            if not s.parts:
                what, flag, one = (
                    ("sequence lengths", "--seq-lens 1024,2048,4096,8192,16384", "length")
                    if axis == "T"
                    else ("head dims", "--head-dims 64,128,256", "head dim")
                )
                s.missing = SWEEP.format(what=what, flag=flag, one=one)
            elif not bench_ok:
                s.parts.insert(0, Section.warning_html(NOT_MEANINGFUL))

        return make

    def stages(s: Section) -> None:
        if data.profile is None:
            s.missing = "no profile.csv: run `dtune profile --config tuned.json --out FOLDER`"
            return
        floors = d.stage_floors(data.profile)
        if not d.meaningful(data.profile):
            s.add_warning(NOT_MEANINGFUL)
        s.add_figure(charts.stage_floors(floors))
        if floors["floor_ms"].isna().all():
            s.add_note("No floors: the ceilings were not measured (no GPU) and no GPU profile was given (--gpu).")
        else:
            s.add_note(
                "A stage's floor is its compulsory bytes at the measured copy bandwidth or its nominal FLOPs at the "
                "measured matmul rate, whichever is longer (dtune.measure.work)."
            )
        table = d.stage_breakdown(data.profile)
        table["share"] = table["share"] * 100
        table = table.rename(
            columns={
                "median_ms": "time (ms)",
                "share": "share of stages (%)",
                "shared_mem": "shared mem (B)",
                "x_floor": "× floor",
                "verdict": "verdict",
            }
        )
        s.add_table(table, sortable=True)

    def baselines(s: Section) -> None:
        if data.bench is None:
            s.missing = "no bench.csv: run `dtune bench --config tuned.json --out FOLDER`"
            return
        frame = d.bench_times(data.bench)
        if not bench_ok:
            s.add_warning(NOT_MEANINGFUL)
        for kernel, grp in frame.groupby("kernel", sort=True):
            s.add_figure(charts.bench_times(grp, str(kernel)))
        table = frame.drop(columns=["T", "K", "series"]).dropna(axis=1, how="all")  # e.g. no fla: no "× vs fla"
        s.add_table(table.rename(columns=d.BENCH_UNITS), sortable=True)

    def roof(s: Section) -> None:
        meaningful_bench = data.bench if bench_ok else None
        meaningful_profile = data.profile if d.meaningful(data.profile) else None
        points = d.roofline_points(meaningful_bench, meaningful_profile)
        if points is None:
            s.missing = "no GPU-timed bench.csv or profile.csv with achieved TFLOP/s"
            return
        roofs = d.roofs(data)
        s.add_figure(charts.roofline(points, roofs))
        if not roofs:
            s.add_note("No roofs drawn: no GPU profile in run.json and no ceilings measured (dtune profile on a GPU).")
        s.add_note(
            "FLOPs are nominal (chunk: 2C(3K+2V)+6KV per token per head, C = 64) and bytes compulsory "
            "(q, k, v, o, beta, g and any state), as in docs/anchors/fla-0.6.0_h200.md."
        )

    def search(s: Section) -> None:
        if data.trials is None or not {"state", "time_ms", "study"} <= set(data.trials.columns):
            best = d.tuned_frame(data.tuned)
            if best is None:
                s.missing = "no trials.csv or tuned.json: no search in these folders"
                return
            s.add_note("Best configuration per shape (tuned.json; speedup over the template's default at search time):")
            s.add_table(d.search_table(best), sortable=True)
            s.add_definitions(d.best_configs(best))
            return
        trials = data.trials
        s.add_note(
            "Best configuration per shape. The speedup is over the template's default config at the time of the "
            "search (its baseline), not over fla: the first section compares with fla."
        )
        best = d.best_per_shape(trials)
        s.add_table(d.search_table(best), sortable=True)
        s.add_note("The best config of each shape:")
        s.add_definitions(d.best_configs(best))
        history = d.search_history(trials)
        if len(history) and history.groupby("study").size().max() >= 2:  # a history needs two points
            s.add_figure(charts.search_history(history))
        lost = d.failures_by_reason(trials)
        if len(lost):
            s.add_figure(charts.failures(lost))
        imp_frames = [d.param_importance(db, MIN_COMPLETE_FOR_IMPORTANCE)[0] for db in data.study_dbs]
        imp = [f for f in imp_frames if not f.empty]
        if imp:
            import pandas as pd

            frame = pd.concat(imp, ignore_index=True)
            s.add_note(
                f"Parameter importance ({frame['evaluator'].iloc[0]}, share of the variance of the completed trials' "
                "times): the three most important parameters of each study. A pattern search's trials are not a "
                "random sample, so read these as hints."
            )
            s.add_table(d.importance_table(frame), sortable=True)

    def trials(s: Section) -> None:
        if data.trials is None or "study" not in data.trials.columns:
            s.missing = "no trials.csv"
            return
        frame = d.trial_table(data.trials)
        if len(frame) > MAX_TABLE_ROWS:
            s.add_note(f"{len(frame)} trials: showing the first {MAX_TABLE_ROWS}; trials.csv has them all.")
            frame = frame.head(MAX_TABLE_ROWS)
        s.add_note("Click a column header to sort.")
        s.add_table(frame, sortable=True)

    def launches(s: Section) -> None:
        launch_section(s, data)

    sections = [
        _guarded("answer", "dtune vs flash-linear-attention", answer),
        _guarded("speedup-T", "Speedup vs sequence length", sweep("T")),
        _guarded("speedup-D", "Speedup vs head dim", sweep("K")),
        _guarded("stages", "Per-stage time vs its floor", stages),
        _guarded("launches", "Every launch of the forward and the training step", launches),
        _guarded("baselines", "Time per call, each implementation", baselines),
        _guarded("roofline", "Roofline", roof),
        _guarded("search", "The search", search),
        _guarded("trials", "All trials", trials),
    ]
    sections.append(_environment(data, [s for s in sections if s.state != "ok"]))
    return sections


def launch_section(s: Section, data: d.RunData) -> None:
    """Every launch of a call (``dtune profile --mode fwd,fwd+bwd``, ``launches.csv``): per call one chart of each
    contestant's launches (dtune's by stage) against the whole call and the op's floor, then the table."""
    if data.launches is None:
        s.missing = "no launches.csv: run `dtune profile -k KERNEL --mode fwd,fwd+bwd --out FOLDER`"
        return
    if not d.meaningful(data.launches):
        s.add_warning(NOT_MEANINGFUL)
    bars = d.launch_segments(data.launches)
    for group, grp in bars.groupby("group", sort=False):
        s.add_figure(charts.launch_segments(grp, str(group)))
    s.add_note(
        "Device time per call of every kernel launched (torch.profiler, the mean of several calls), dtune's launches "
        "grouped by the stage they run, a peer's by kernel. A dtune stage's floor (in the table, on its first "
        "launch) is the bytes that launch must move at the measured copy bandwidth or its nominal FLOPs at the "
        "measured matmul rate (dtune.measure.work: the forward's plan stages, backward_stages for the step); the "
        "whole op's floor, the same for every contestant, counts only compulsory bytes."
    )
    s.add_table(d.launch_table(data.launches), sortable=True)


def _environment(data: d.RunData, left_out: Sequence[Section]) -> Section:
    s = Section("environment", "Environment and sources")
    env = d.environment(data.run)
    env.pop("Commit", None)  # commits are per source, below: one place, no second opinion
    if len(data.runs) > 1:  # several searches: only what they share (the sources table lists each)
        env = {k: v for k, v in env.items() if k in ("GPU", "GPU roofs", "Interpreter")}
        versions = sorted({", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items()) for r in data.runs})
        env["Versions"] = "; ".join(v for v in versions if v) or "not recorded"
        kernels = sorted({str(r.get("kernel")) for r in data.runs})
        env["Searches"] = f"{len(data.runs)} run folders: {', '.join(kernels)}"
    if env:
        s.add_definitions(env)
    gpus = sorted({str((r.get("gpu") or {}).get("key")) for r in data.runs if r.get("gpu")})
    if len(gpus) > 1:
        s.add_warning(f"These folders mix GPUs: {', '.join(gpus)}.")
    sources = d.sources_frame(data)
    if len(sources):
        s.add_note("Every file this report read, with the commit it was made at:")
        s.add_table(sources)
    for note in data.notes:
        s.add_note(f"provenance: {note}")
    for problem in data.problems:
        s.add_warning(f"could not read {problem}")
    if left_out:
        s.add_list("Left out of this report (no data):", [f"{x.title}: {x.missing}" for x in left_out])
    if not s.parts:
        s.missing = "no run.json, trials.csv, bench.csv or profile.csv in these folders"
    return s


def _subtitle(data: d.RunData) -> str:
    kernels: set[str] = set()
    for frame in (data.trials, data.bench, data.profile):
        if frame is not None and "kernel" in frame.columns:
            kernels |= set(frame["kernel"].astype(str))
    gpu = (data.run.get("gpu") or {}).get("name", "")
    commits = d.commits(data)
    parts = [
        ", ".join(sorted(kernels)) if len(kernels) <= 3 else f"{len(kernels)} kernels",
        str(gpu),
        f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}" if commits else "",
        f"generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
    ]
    return " · ".join(p for p in parts if p)


def build_report(
    run_dirs: str | Path | Sequence[str | Path], output: str | Path | None = None
) -> tuple[Path, dict[str, str]]:
    """Write the report of one or several folders (default: reports/<first folder's name>.html); return its path and
    each section's state ("ok", or why it was left out). :class:`NothingToReport` when the folders hold nothing that
    could be read."""
    paths = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    data = d.load_run(paths)
    if (
        not any(x is not None for x in (data.trials, data.bench, data.profile, data.launches, data.tuned))
        and not data.runs
    ):
        where = ", ".join(str(p) for p in paths)
        unread = " ".join(f" (could not read: {'; '.join(data.problems)})".split()) if data.problems else ""
        raise NothingToReport(
            f"nothing to report in {where}: no run.json, trials.csv, bench.csv, profile.csv, launches.csv or "
            f"tuned.json{unread}"
        )
    sections = build_sections(data)
    out = Path(output) if output is not None else default_output(paths[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = (data.run.get("gpu") or {}).get("name")
    title = f"dtune on {gpu}" if gpu else f"dtune report: {data.name}"
    shown = [s for s in sections if s.state == "ok"]
    out.write_text(page(title, _subtitle(data), shown), encoding="utf-8")
    return out, {s.key: s.state for s in sections}
