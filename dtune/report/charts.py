"""Plotly figures, one per chart of the report, each drawn from the frame :mod:`dtune.report.data` shapes."""

from __future__ import annotations

import math

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dtune.measure.work import Roofs

from . import data as d

LAYOUT = {"template": "plotly_white", "height": 420, "margin": {"l": 60, "r": 20, "t": 50, "b": 60}}


def _styled(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=title, **LAYOUT)
    return fig


def speedup_vs_seq_len(frame: pd.DataFrame, against: str = "the untuned default") -> go.Figure:
    fig = px.line(frame, x="T", y="speedup", color="line", markers=True, log_x=True, hover_data=["best_ms", "dtype"])
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_xaxes(title="sequence length T")
    fig.update_yaxes(title=f"speedup vs {against} (×)")
    return _styled(fig, f"Tuned config vs {against}, by sequence length (a line per head dim)")


def speedup_vs_head_dim(frame: pd.DataFrame, against: str = "the untuned default") -> go.Figure:
    fig = px.line(frame, x="K", y="speedup", color="line", markers=True, hover_data=["best_ms", "dtype"])
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    dims = sorted(int(k) for k in frame["K"].unique())  # categories in numeric order, not order of appearance
    fig.update_xaxes(title="head dim D (K = V)", type="category", categoryorder="array", categoryarray=dims)
    fig.update_yaxes(title=f"speedup vs {against} (×)")
    return _styled(fig, f"Tuned config vs {against}, by head dim (a line per sequence length)")


def bench_times(frame: pd.DataFrame) -> go.Figure:
    fig = px.bar(
        frame,
        x="shape",
        y="median_ms",
        color="series",
        barmode="group",
        facet_row="kernel" if frame["kernel"].nunique() > 1 else None,
        hover_data=["speedup_vs_default", "speedup_vs_fla", "meaningful"],
    )
    fig.update_yaxes(title="median ms (log scale, lower is better)", type="log")
    fig.update_xaxes(title="shape")
    return _styled(fig, "Time per call: tuned vs each baseline")


def stage_breakdown(frame: pd.DataFrame) -> go.Figure:
    fig = px.bar(
        frame,
        x="median_ms",
        y="shape",
        color="stage",
        orientation="h",
        hover_data=[
            c for c in ("share", "registers", "spills", "shared_mem", "x_floor", "bound") if c in frame.columns
        ],
    )
    fig.update_xaxes(title="ms per call (stacked by stage)")
    fig.update_yaxes(title="")
    return _styled(fig, "Per-stage time breakdown")


def roofline(points: pd.DataFrame, roof_list: list[Roofs]) -> go.Figure:
    lo = 10 ** math.floor(math.log10(max(points["intensity"].min(), 1e-3)) - 0.5)
    hi = 10 ** math.ceil(math.log10(max(points["intensity"].max(), *(r.ridge for r in roof_list), 1.0)) + 0.5)
    fig = go.Figure()
    lines = d.roof_lines(roof_list, lo, hi)
    for i, (name, grp) in enumerate(lines.groupby("roof", sort=False) if len(lines) else []):
        style = {"dash": "dash" if i else "solid", "color": "#333" if i else "#999", "width": 2}
        fig.add_trace(go.Scatter(x=grp["intensity"], y=grp["tflops"], mode="lines", name=str(name), line=style))
    palette = px.colors.qualitative.Dark24
    for i, (name, grp) in enumerate(points.groupby("group", sort=True)):
        symbol = "diamond" if str(name).startswith("profile") else "circle"
        fig.add_trace(
            go.Scatter(
                x=grp["intensity"],
                y=grp["tflops"],
                mode="markers",
                name=str(name),
                text=grp["label"],
                marker={"size": 10, "symbol": symbol, "color": palette[i % len(palette)], "opacity": 0.85},
                hovertemplate="%{text}<br>%{x:.1f} FLOP/B, %{y:.2f} TFLOP/s<extra></extra>",
            )
        )
    fig.update_xaxes(type="log", title="arithmetic intensity (nominal FLOP / compulsory byte)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    return _styled(fig, "Roofline")


def search_history(frame: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for study, grp in frame.groupby("study", sort=True):
        fig.add_trace(
            go.Scatter(x=grp["number"], y=grp["best_so_far"], mode="lines", name=f"{study} best", line={"shape": "hv"})
        )
        fig.add_trace(
            go.Scatter(
                x=grp["number"],
                y=grp["time_ms"],
                mode="markers",
                name=f"{study} trials",
                opacity=0.35,
                marker={"size": 5},
            )
        )
    fig.update_xaxes(title="trial number")
    fig.update_yaxes(title="ms (best so far)", type="log")
    return _styled(fig, "Search history")


def param_importance(frame: pd.DataFrame) -> go.Figure:
    grid = frame.pivot_table(index="param", columns="study", values="importance", aggfunc="mean").fillna(0.0)
    grid = grid.loc[grid.mean(axis=1).sort_values().index]
    fig = px.imshow(grid, color_continuous_scale="Blues", zmin=0, zmax=1, text_auto=".2f", aspect="auto")
    fig.update_xaxes(title="study", tickangle=-30)
    fig.update_yaxes(title="")
    fig.update_layout(coloraxis_colorbar={"title": "importance"})
    return _styled(fig, f"Parameter importance ({frame['evaluator'].iloc[0]}, normalised per study)")


def failures(frame: pd.DataFrame) -> go.Figure:
    fig = px.bar(frame, x="reason", y="count", color="state", text="count")
    fig.update_yaxes(title="trials")
    return _styled(fig, "Trials lost, by reason")
